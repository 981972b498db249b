"""One env-server replica: agent-env's ``build_app`` over a bundle, served by uvicorn on a fixed port in a thread of a
Ray actor that runs on the env server's own Python (``runtime_env`` ``py_executable``), so Ray restarts it in place
and the pool finds it again at the same URL.

The replica keeps everything of its own in one folder on its node: ``replica.log`` (the process's stdout and
stderr, every instance's in turn), ``state/`` (agent-env's per-user state, a store that grows by a row an episode)
and ``sandboxes/`` (the local sandboxes of its episodes, each with the tool servers it started). An instance that
starts, and one that stops, first tears down what an earlier instance left in it: a replica killed mid-episode
leaves its sandboxes, their processes and their Docker containers behind, which agent-env's own sandbox teardown
finds by the sandbox's id. This module imports agent-env and uvicorn only inside the actor, where they are
installed; the trainer's environment lacks them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import ray

LOG = "replica.log"
_STATE = "state"
_SANDBOXES = "sandboxes"
_WORK_DIR_PREFIX = "agent-env-"
_STOP_S = 30.0
# What a hand-started replica is told in README, and what uvicorn's own default timeout undercuts: a session waiting
# on a slow model still answers pings, and a dead client is found within a minute.
_WS_PING_INTERVAL_S = 20.0
_WS_PING_TIMEOUT_S = 60.0

logger = logging.getLogger(__name__)


class EnvReplica:
    """A bundle served on ``port`` of this node by agent-env's real server, with its log, state and sandboxes in
    ``folder``. Creating it returns once the server listens; ``url`` says where; ``stop`` shuts it down as uvicorn's
    shutdown does (open episodes torn down, sessions closed) and removes what it leaves."""

    def __init__(self, bundle: str, port: int, max_concurrent_envs: int, folder: str):
        self._folder = Path(folder)
        self._folder.mkdir(parents=True, exist_ok=True)
        restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        _log_to(self._folder / LOG, restarted)
        logger.info(
            "%s replica of %s in pid %d, port %d",
            "restarted by Ray: a" if restarted else "starting a",
            bundle,
            os.getpid(),
            port,
        )
        os.environ["XDG_STATE_HOME"] = str(self._folder / _STATE)
        os.environ["AGENT_ENV_LOCAL_SANDBOX_DIR"] = str(self._folder / _SANDBOXES)
        for problem in _remove_leftovers(self._folder):
            logger.warning("left behind by an earlier instance: %s", problem)
        listening = _listen(port)

        # Imported here, after the state folders are set, and only here: only the env server's Python has them.
        import uvicorn
        from agent_env.openenv import build_app

        app = build_app(Path(bundle), max_concurrent_envs=max_concurrent_envs)
        config = uvicorn.Config(
            app,
            log_level="info",
            access_log=False,
            ws_ping_interval=_WS_PING_INTERVAL_S,
            ws_ping_timeout=_WS_PING_TIMEOUT_S,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [listening]}, name="env-server", daemon=True
        )
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the env server on port {port} stopped before it served; its log is above")
            time.sleep(0.05)
        self._url = f"http://{ray.util.get_node_ip_address()}:{port}"
        logger.info("serving %s at %s", bundle, self._url)

    def url(self) -> str:
        """Where the replica serves: ``http://<node IP>:<port>``."""
        return self._url

    def stop(self) -> None:
        """Shut the server down (uvicorn closes every session with 1012 and the app tears down open episodes), then
        remove the replica's state and sandboxes. Raises RuntimeError when the server doesn't stop within 30 s or
        something it started can't be removed; the log says more."""
        logger.info("stopping")
        self._server.should_exit = True
        self._thread.join(_STOP_S)
        if self._thread.is_alive():
            raise RuntimeError(f"the env server at {self._url} didn't shut down within {_STOP_S:g} s")
        if problems := _remove_leftovers(self._folder):
            raise RuntimeError(f"the env server at {self._url} left behind: {'; '.join(problems)}")
        logger.info("stopped")


def _log_to(path: Path, restarted: bool) -> None:
    """Send this process's stdout and stderr (Python's, agent-env's, uvicorn's and Ray's own lines alike) to
    ``path``, which a first instance starts anew and a restarted one appends to."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if restarted else os.O_TRUNC)
    log = os.open(path, flags, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s [env_replicas] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _remove_leftovers(folder: Path) -> list[str]:
    """Tear down every local sandbox left in ``folder``'s sandboxes (its processes, its labelled Docker containers,
    its work folder) with agent-env's own teardown, then remove the sandboxes and state folders. Returns what
    couldn't be removed, empty when all went."""
    sandboxes, problems = folder / _SANDBOXES, []
    if sandboxes.is_dir() and any(sandboxes.iterdir()):
        problems += asyncio.run(_tear_down(sandboxes))
    for each in (sandboxes, folder / _STATE):
        shutil.rmtree(each, ignore_errors=True)
        if each.exists():
            problems.append(f"{each} can't be removed")
    return problems


async def _tear_down(sandboxes: Path) -> list[str]:
    """Terminate each sandbox whose work folder lies in ``sandboxes``; the problems met, one line each."""
    from agent_env.providers import build_sandbox_provider

    provider, problems = build_sandbox_provider("local"), []
    for work_dir in sorted(sandboxes.glob(f"{_WORK_DIR_PREFIX}*")):
        # A work folder is named agent-env-<sandbox id>-<mkdtemp's suffix>, which has no hyphen.
        sandbox_id = work_dir.name.removeprefix(_WORK_DIR_PREFIX).rsplit("-", 1)[0]
        try:
            await (await provider.get_sandbox(sandbox_id)).terminate()
        except Exception as e:
            problems.append(f"sandbox {sandbox_id}: {type(e).__name__}: {e}")
        else:
            logger.info("tore down sandbox %s", sandbox_id)
    return problems


def _listen(port: int) -> socket.socket:
    """A socket listening on ``port`` on every address of this node. Raises OSError naming the port when another
    process holds it."""
    try:
        return socket.create_server(("0.0.0.0", port), backlog=2048)
    except OSError as e:
        raise OSError(e.errno, f"port {port} of this node is taken ({e.strerror}): name another --port") from None
