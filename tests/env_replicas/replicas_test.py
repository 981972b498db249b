"""Env replicas on a 2-node Ray cluster, brought up and down with ``python -m env_replicas`` as a user would, played
through chat_core's pool: a Python without Ray is refused before anything starts; one replica on each node, each
playing a scored episode; a replica SIGKILLed mid-episode costs that episode alone, is restarted by Ray with its
leftovers removed and plays again at the same URL; ``down`` leaves no actor, tool server or sandbox.

The tests after the first share one deployment and run in order: the last one brings it down."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
import test_support
from chat_core import ENV_SERVERS_VARIABLE, ChatEndpoint, EpisodeResult, FlagKind, Limits, play
from conftest import ENV_PYTHON, NODE_CPUS, RAYLESS_PYTHON
from env_replicas import NAMESPACE, EnvReplicas, NodesUnready, running_replicas, up
from ray.cluster_utils import Cluster
from test_support import SAMPLE_BUNDLE, SCRIPTS, ScriptedModel, delay, text, tool_call
from test_support.replicas import free_ports, serves, serving_pid
from test_support.waits import until

pytest_plugins = ["test_support.pytest_plugin"]

NAME = "sample"
TEST_SUPPORT = Path(test_support.__file__).resolve().parent.parent
"""The folder that makes ``test_support`` importable, for the env type (``local_tools``) the replicas load."""
_COMMAND_S = 300


@dataclass(frozen=True)
class Deployment:
    """What ``python -m env_replicas up`` gave: the replicas' URLs as the file it wrote names them, and what it
    printed."""

    urls: list[str]
    written: str
    printed: str

    def folder(self, url: str, state_dir: Path) -> Path:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        return state_dir / NAME / f"{host}-{port}"


def _env_replicas(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "env_replicas", *args],
        capture_output=True,
        text=True,
        timeout=_COMMAND_S,
        check=False,
    )


@pytest.fixture(scope="module")
def deployment(cluster: Cluster, state_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """One replica of the sample bundle on each node, 4 sessions each, reserving a CPU each, brought up by the
    command; brought down at the end if the last test didn't."""
    folder = tmp_path_factory.mktemp("deployment")
    config = folder / "agent-env.toml"
    config.write_text('[envs]\nimpls = ["test_support.local_tools_env:LocalToolsEnv"]\n')
    port = free_ports(2)
    done = _env_replicas(
        "up", NAME,
        "--bundle", str(SAMPLE_BUNDLE),
        "--env-python", str(ENV_PYTHON),
        "--port", str(port),
        "--max-concurrent-envs", "4",
        "--cpus", "1",
        "--env", f"AGENT_ENV_CONFIG={config}",
        "--env", f"PYTHONPATH={TEST_SUPPORT}",
        "--state-dir", str(state_dir),
        "--address", cluster.address,
        "--write", str(folder / "servers.env"),
    )  # fmt: skip
    assert done.returncode == 0, f"up failed:\n{done.stderr}"
    written = (folder / "servers.env").read_text()
    _, _, urls = written.strip().partition("=")
    yield Deployment(urls.split(","), written, done.stdout)
    if running_replicas(NAME):
        _env_replicas("down", NAME, "--address", cluster.address)


@pytest.fixture(scope="module")
def rows(deployment: Deployment, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The split ``all``'s row metadata by task name, written by ``python -m chat_core.prepare`` from a replica."""
    out = tmp_path_factory.mktemp("rows") / "rows"
    prepared = subprocess.run(
        [sys.executable, "-m", "chat_core.prepare", deployment.urls[0], str(out)],
        capture_output=True,
        text=True,
        timeout=_COMMAND_S,
        check=False,
    )
    assert prepared.returncode == 0, prepared.stderr
    lines = (out / "all.jsonl").read_text().splitlines()
    return {row["metadata"]["episode"]["task_name"]: row["metadata"] for row in map(json.loads, lines)}


def test_an_env_python_without_ray_is_refused_before_anything_starts(cluster: Cluster, state_dir: Path) -> None:
    replicas = EnvReplicas(
        name="rayless", bundle=SAMPLE_BUNDLE, env_python=RAYLESS_PYTHON, port=free_ports(1), state_dir=state_dir
    )

    with pytest.raises(NodesUnready) as refused:
        up(replicas, timeout_s=60)

    message = str(refused.value)
    assert message.startswith("nothing was started")
    for node in ray.nodes():
        where = f"node {node['NodeManagerAddress']} ({node['NodeID']})"
        assert f"{where}: the env server's Python {RAYLESS_PYTHON} has no Ray" in message
    assert f"(ModuleNotFoundError: No module named 'ray'); the cluster runs Ray {ray.__version__}" in message
    assert running_replicas("rayless") == []
    assert not (state_dir / "rayless").exists()


def test_one_replica_on_each_node_plays_a_scored_episode_through_the_pool(
    cluster: Cluster,
    deployment: Deployment,
    rows: dict[str, dict[str, Any]],
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    variable, _, listed = deployment.written.strip().partition("=")
    monkeypatch.setenv(variable, listed)

    async def one_on_each() -> list[EpisodeResult]:
        return await asyncio.gather(
            *(_played(rows["played"], scripted_model, SCRIPTS["played"], f"first{n}") for n in range(2))
        )

    results = asyncio.run(one_on_each())

    assert variable == ENV_SERVERS_VARIABLE
    assert f'episode_env_servers: ["{deployment.urls[0]}", "{deployment.urls[1]}"]' in deployment.printed
    assert [(result.reward, result.flags) for result in results] == [(1.0, [])] * 2
    assert sorted(result.env_server for result in results) == sorted(deployment.urls)
    assert sorted(_raylet_of(url) for url in deployment.urls) == sorted(_raylets(cluster))
    assert ray.available_resources()["CPU"] == 2 * NODE_CPUS - 2


def test_a_replica_killed_mid_episode_costs_that_episode_and_serves_again_at_its_url(
    deployment: Deployment, rows: dict[str, dict[str, Any]], scripted_model: ScriptedModel, state_dir: Path
) -> None:
    doomed, other = deployment.urls
    doomed_folder = deployment.folder(doomed, state_dir)
    slow = [delay(3, tool_call("find_crate", {"name": "pears"})), text("The crate of pears is on shelf 9C.")]
    killed = serving_pid(doomed)

    async def killed_mid_episode() -> tuple[list[EpisodeResult], list[Path], list[int]]:
        playing = [
            asyncio.create_task(_played(rows["played"], scripted_model, slow, f"mid{n}", deployment.urls))
            for n in range(2)
        ]
        await until(lambda: all(scripted_model.requests_of(f"mid{n}") for n in range(2)), "both episodes playing")
        sandboxes, tool_servers = _sandboxes(doomed_folder), _tool_servers(doomed_folder)
        os.kill(killed, signal.SIGKILL)
        return await asyncio.gather(*playing), sandboxes, tool_servers

    during, sandboxes_before, tool_servers_before = asyncio.run(killed_mid_episode())
    asyncio.run(until(lambda: serves(doomed), f"{doomed} serving again", timeout=120))
    sandboxes_after, tool_servers_after = _sandboxes(doomed_folder), _tool_servers(doomed_folder)
    again = asyncio.run(_played(rows["played"], scripted_model, SCRIPTS["played"], "again", [doomed]))

    on_doomed = next(result for result in during if result.env_server == doomed)
    on_other = next(result for result in during if result.env_server == other)
    assert not on_doomed.scored and [flag.kind for flag in on_doomed.flags] == [FlagKind.PROTOCOL_ERROR]
    assert (on_other.reward, on_other.flags) == (1.0, [])
    assert (len(sandboxes_before), len(tool_servers_before)) == (1, 1)
    assert (sandboxes_after, tool_servers_after) == ([], [])
    assert serving_pid(doomed) != killed
    assert "restarted by Ray" in (doomed_folder / "replica.log").read_text()
    assert (again.reward, again.flags, again.env_server) == (1.0, [], doomed)


def test_down_stops_every_replica_and_leaves_no_actor_tool_server_or_sandbox(
    cluster: Cluster,
    deployment: Deployment,
    rows: dict[str, dict[str, Any]],
    scripted_model: ScriptedModel,
    state_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = [delay(3, tool_call("find_crate", {"name": "pears"})), text("The crate of pears is on shelf 9C.")]

    async def down_mid_episode() -> tuple[EpisodeResult, list[int], subprocess.CompletedProcess[str]]:
        playing = asyncio.create_task(_played(rows["played"], scripted_model, slow, "last"))
        await until(lambda: bool(scripted_model.requests_of("last")), "the episode playing")
        tool_servers = _tool_servers(state_dir / NAME)
        stopped = await asyncio.to_thread(_env_replicas, "down", NAME, "--address", cluster.address)
        return await playing, tool_servers, stopped

    monkeypatch.setenv(ENV_SERVERS_VARIABLE, ",".join(deployment.urls))
    interrupted, tool_servers_before, stopped = asyncio.run(down_mid_episode())

    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip() == f"stopped 2 replica(s) of {NAME}"
    assert not interrupted.scored and interrupted.flags
    assert len(tool_servers_before) == 1
    assert [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE] == []
    assert _tool_servers(state_dir / NAME) == []
    for url in deployment.urls:
        folder = deployment.folder(url, state_dir)
        assert sorted(path.name for path in folder.iterdir()) == ["replica.log"]
        assert not serves(url)
    asyncio.run(until(lambda: ray.available_resources().get("CPU") == 2 * NODE_CPUS, "the replicas' CPUs freed"))


async def _played(
    metadata: dict[str, Any], model: ScriptedModel, steps: Any, session: str, servers: Sequence[str] = ()
) -> EpisodeResult:
    model.script(steps, session=session)
    chat = ChatEndpoint(model.base_url + "/chat/completions", "policy", {"Authorization": f"Bearer {session}"})
    return await play(metadata, chat, {}, Limits(), env_servers=servers)


def _raylets(cluster: Cluster) -> list[int]:
    """The raylet process of each of the cluster's nodes."""
    nodes = [cluster.head_node, *cluster.worker_nodes]
    return [node.all_processes[ray._private.ray_constants.PROCESS_TYPE_RAYLET][0].process.pid for node in nodes]


def _raylet_of(url: str) -> int:
    """The raylet that started the process serving ``url``: which node it runs on."""
    return psutil.Process(serving_pid(url)).ppid()


def _sandboxes(folder: Path) -> list[Path]:
    """The local sandboxes' work folders in a replica's folder."""
    return sorted((folder / "sandboxes").glob("agent-env-*"))


def _tool_servers(folder: Path) -> list[int]:
    """The warehouse tool servers running from a sandbox under ``folder``."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(process.info["cmdline"] or ())
        if "tool_server.py" in command and str(folder) in command:
            found.append(process.info["pid"])
    return found
