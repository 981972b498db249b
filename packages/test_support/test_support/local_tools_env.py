"""An agent-env env type that gives each episode its own warehouse tool server without Docker.

agent-env's own env types deploy through Docker, which test machines lack. This one, registered through the
``[envs] impls`` table of the config file ``AGENT_ENV_CONFIG`` names (``serve_bundle`` writes it), makes a local
sandbox, a work folder on this machine, and starts ``tool_server.py`` in it. The sandbox is recorded on the deployed
env, so the run's normal teardown stops the server and removes the folder, on an abandoned episode and at server
shutdown too. A bundle's ``envs/<name>/env.toml`` names it with ``type = "local_tools"`` and may set
``stock = { <crate> = "<shelf>", ... }``, the crates the warehouse starts with, and ``ships = true``, for a warehouse
whose tools also list ``ship_crate`` once a crate was added (tools that change between an episode's turns).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from agent_env.env.env import DeployedSandboxEnv, Env
from agent_env.providers import build_sandbox_provider
from agent_env.providers.sandbox_providers.local_sandbox import LocalSandbox, remove_local_work_dir

TOOL_SERVER = Path(__file__).with_name("tool_server.py")
STARTUP_TIMEOUT_SECONDS = 30.0


class LocalToolsEnv(Env):
    """A warehouse tool server in a local sandbox, one per deploy."""

    type: ClassVar[str] = "local_tools"
    description = "A warehouse's MCP tools, served from a local sandbox on this machine"

    def __init__(
        self,
        id: str,
        version: int | None,
        stock: dict[str, str] | None = None,
        metadata: dict[str, Any] | None = None,
        ships: bool = False,
    ):
        super().__init__(id, version, metadata=metadata)
        self.stock = dict(stock or {})
        self.ships = ships

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "stock": self.stock, "ships": self.ships}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LocalToolsEnv:
        """The env a stored document or an env.toml describes. Raises ValueError for a key it doesn't take, and for a
        ``stock`` that isn't a table of crate names to shelves, or ``ships`` that isn't true or false."""
        if unknown := sorted(set(data) - {"id", "type", "version", "metadata", "stock", "ships"}):
            raise ValueError(f"a local_tools env takes stock and ships, not {', '.join(unknown)}")
        stock = data.get("stock") or {}
        if not (isinstance(stock, dict) and all(isinstance(v, str) for v in stock.values())):
            raise ValueError(
                f'stock must be a table of crate names to shelves, such as {{ apples = "4B" }}, not {stock!r}'
            )
        if not isinstance(ships := data.get("ships", False), bool):
            raise ValueError(f"ships is true or false, not {ships!r}")
        return cls(id=data["id"], version=data.get("version"), stock=stock, metadata=data.get("metadata"), ships=ships)

    async def deploy(self, *, sandbox_type: str | None = None, **options: Any) -> DeployedSandboxEnv:
        """Start a tool server in a new local sandbox and return its record, whose sandbox the run tears down.
        Raises ValueError for a ``sandbox_type`` other than ``local``, and RuntimeError, having removed the sandbox,
        when the server isn't listening within STARTUP_TIMEOUT_SECONDS."""
        if sandbox_type not in (None, "local"):
            raise ValueError(f"a local_tools env runs only in a local sandbox, not a {sandbox_type!r} one")
        sandbox = await build_sandbox_provider("local").create_vm()
        try:
            port = await _start_tool_server(sandbox, self.stock, self.ships)
        except BaseException:
            await sandbox.terminate()
            await asyncio.to_thread(remove_local_work_dir, sandbox.sandbox_id)
            raise
        return DeployedSandboxEnv(
            env_id=self.id,
            env_version=self.version,
            mcp_url=f"http://127.0.0.1:{port}/mcp",
            sandbox_id=sandbox.sandbox_id,
            sandbox_type="local",
        )


async def _start_tool_server(sandbox: LocalSandbox, stock: dict[str, str], ships: bool) -> int:
    """The port of a tool server started through the sandbox, which marks it as the sandbox's to stop."""
    port_file, log = sandbox.work_dir / "port", sandbox.work_dir / "tool_server.log"
    command = shlex.join(
        [sys.executable, str(TOOL_SERVER), str(port_file), json.dumps(stock), *(["ships"] if ships else [])]
    )
    pid = int((await sandbox.exec_script(f"nohup {command} >{shlex.quote(str(log))} 2>&1 & echo $!")).strip())
    deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
    while not port_file.exists():
        if not _running(pid):
            raise RuntimeError(f"the warehouse tool server exited; its log ends:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the warehouse tool server wasn't listening in {STARTUP_TIMEOUT_SECONDS:g}s; its log "
                f"ends:\n{_tail(log)}"
            )
        await asyncio.sleep(0.02)
    return int(port_file.read_text())


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-2000:]
    except OSError as e:
        return f"(unreadable: {e})"
