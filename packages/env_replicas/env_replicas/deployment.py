"""Env replicas on the Ray cluster this process is connected to: ``up`` checks every node, starts one detached
actor per replica, waits for each to serve and checks they all serve the same tasks; ``down`` stops them.

Pipeline of ``up``: nodes chosen → each node inspected (``checks``) → replicas placed, ports counted up per address →
actors started → each one's URL → each URL's Task API from here → the pool's own check of the replicas
(``chat_core.env.bundle.check_same_bundle``). A failure at any stage after the first actor started stops every replica
of the deployment before it is raised.

Each replica is an ``EnvReplica`` actor named ``<deployment>/<ip>:<port>`` in the namespace ``env_replicas``,
detached (it outlives the process that called ``up``), restarted by Ray however often it dies (``max_restarts=-1``)
on the node it was placed on (hard node affinity: a soft one, or SPREAD, moves replicas on restart or stacks them on
one node), reserving ``cpus`` CPUs in Ray's accounting. It runs on the env server's Python through ``runtime_env``
``py_executable``. The code Ray runs on a node (the replica, the node checks) is pickled by value, so neither that
Python nor the cluster's needs this package installed: the env server's needs only agentenv-framework[openenv],
uvicorn and the cluster's Ray. (A ``py_modules`` runtime env would ship the package too, but Ray takes a local folder
there only from ``ray.init``, which is the caller's.)
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.cloudpickle
from chat_core import ENV_SERVERS_VARIABLE, OpenEnvError, ServerMismatch, ServerUnreachable
from chat_core.env.bundle import check_same_bundle
from chat_core.env.task_api import OpenEnvServer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from env_replicas import checks
from env_replicas import replica as replica_module
from env_replicas.errors import AlreadyUp, NodesUnready, ReplicaFailed, ReplicasDiffer, ReplicasError
from env_replicas.replica import LOG, EnvReplica

for _shipped in (checks, replica_module):
    ray.cloudpickle.register_pickle_by_value(_shipped)

NAMESPACE = "env_replicas"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_LOG_TAIL_CHARS = 4000
_ASK_AGAIN_S = 0.25

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvReplicas:
    """The replicas of one deployment: ``per_node`` replicas of ``bundle`` on each of ``nodes`` (IPs or Ray node
    ids; every alive node when empty), served on ``env_python``. ``bundle`` and ``env_python`` are absolute paths
    that must exist on every node. A node's replicas serve on ``port``, ``port + 1``, ...; several Ray nodes sharing an
    IP count on from each other's ports. Each admits ``max_concurrent_envs`` episodes at once, reserves ``cpus``
    CPUs, runs with ``env_vars`` added to its environment (agent-env's ``AGENT_ENV_CONFIG``, credentials, a
    ``PYTHONPATH`` for an env type of your own) and keeps its log, state and sandboxes in
    ``<state_dir>/<name>/<ip>-<port>/`` on its node. Raises ValueError for a value out of range."""

    name: str
    bundle: Path
    env_python: Path
    per_node: int = 1
    nodes: tuple[str, ...] = ()
    port: int = 8000
    max_concurrent_envs: int = 8
    cpus: float = 1.0
    env_vars: Mapping[str, str] = field(default_factory=dict)
    state_dir: Path = Path("/tmp/env-replicas")

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"a deployment's name is letters, digits and _.- (starting with a letter or digit), not {self.name!r}"
            )
        for setting in ("bundle", "env_python", "state_dir"):
            path = Path(getattr(self, setting))
            if not path.is_absolute():
                raise ValueError(f"{setting} must be an absolute path, the same on every node, not {path}")
            object.__setattr__(self, setting, path)
        if self.per_node < 1 or self.max_concurrent_envs < 1:
            raise ValueError("per_node and max_concurrent_envs must be at least 1")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be a TCP port, not {self.port}")
        if self.cpus < 0:
            raise ValueError(f"cpus can't be negative: {self.cpus}")
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "env_vars", dict(self.env_vars))


@dataclass(frozen=True)
class Replica:
    """One replica: its actor's ``name``, the node it runs on, where it serves, and its log on that node."""

    name: str
    node_id: str
    node_ip: str
    port: int
    url: str
    log: Path

    @property
    def folder(self) -> Path:
        return self.log.parent


def up(replicas: EnvReplicas, *, timeout_s: float = 300.0) -> tuple[Replica, ...]:
    """Bring ``replicas`` up and return them once each serves its Task API to this process and all serve the same
    env and task ids. Raises AlreadyUp when the deployment has replicas already; NodesUnready, naming each node and
    what it lacks, before anything starts; ReplicaFailed with the replica's log when one doesn't serve within
    ``timeout_s`` seconds of the call, and ReplicasDiffer when they fail the pool's check, in both cases once every
    replica it started is stopped again; ReplicasError when this process isn't connected to a cluster."""
    _require_connected()
    began = time.monotonic()
    if running := running_replicas(replicas.name):
        raise AlreadyUp(
            f"{len(running)} replica(s) of {replicas.name!r} run already ({', '.join(running)}): "
            f"bring them down first (python -m env_replicas down {replicas.name})"
        )
    placed = _placed(replicas, _nodes(replicas))
    _check_nodes(replicas, placed, timeout_s)
    logger.info(
        "nodes checked in %.1f s; starting %d replica(s) of %s", time.monotonic() - began, len(placed), replicas.bundle
    )
    try:
        started = _started(replicas, placed, began + timeout_s)
        _check_served(started, began + timeout_s)
    except BaseException:
        _stop(replicas.name, timeout_s=60.0, strict=False)
        raise
    logger.info("%d replica(s) of %s serving after %.1f s", len(started), replicas.name, time.monotonic() - began)
    return started


def down(name: str, *, timeout_s: float = 60.0) -> tuple[str, ...]:
    """Stop every replica of deployment ``name`` gracefully (sessions closed, open episodes and their sandboxes torn
    down, its state removed; its log stays), then end its actor; returns the replicas' names, none when nothing
    runs. Raises ReplicaFailed, once every actor is ended, naming each replica that didn't stop cleanly within
    ``timeout_s`` seconds."""
    _require_connected()
    return _stop(name, timeout_s=timeout_s, strict=True)


def running_replicas(name: str) -> list[str]:
    """The names of deployment ``name``'s replica actors on the cluster."""
    prefix = f"{name}/"
    listed = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in listed if a["namespace"] == NAMESPACE and a["name"].startswith(prefix))


def launch_settings(urls: Sequence[str]) -> str:
    """The replicas' URLs in each form the trainer helpers read a pool from, one per line, each after a comment
    saying where it goes."""
    quoted = ", ".join(f'"{url}"' for url in urls)
    return "\n".join(
        [
            "# any trainer: in the environment of its rollout processes (ray job submit --runtime-env-json ...)",
            f"{ENV_SERVERS_VARIABLE}={','.join(urls)}",
            "# slime: in the YAML file --custom-config-path names",
            f"episode_env_servers: [{quoted}]",
            "# Miles: in the module --custom-agent-function-path names",
            f"run = make_agent(env_servers=[{quoted}])",
        ]
    )


def _require_connected() -> None:
    if not ray.is_initialized():
        raise ReplicasError("this process isn't connected to a Ray cluster: ray.init(address=...) first")


def _nodes(replicas: EnvReplicas) -> list[dict[str, Any]]:
    """The alive nodes ``replicas`` go on, in order of IP and node id. Raises NodesUnready when a named node isn't
    alive, or a node has fewer CPUs in all than its replicas reserve."""
    alive = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
    chosen = alive
    if replicas.nodes:
        unknown = [
            each for each in replicas.nodes if not any(each in (n["NodeID"], n["NodeManagerAddress"]) for n in alive)
        ]
        if unknown:
            raise NodesUnready(
                f"no alive node is {', '.join(unknown)}; the alive ones are "
                + ", ".join(f"{n['NodeManagerAddress']} ({n['NodeID']})" for n in alive)
            )
        chosen = [n for n in alive if {n["NodeID"], n["NodeManagerAddress"]} & set(replicas.nodes)]
    needed = replicas.per_node * replicas.cpus
    short = [
        f"node {_node_name(n)} has {n['Resources'].get('CPU', 0):g} CPUs in all; {replicas.per_node} replica(s) of "
        f"{replicas.cpus:g} CPUs need {needed:g}"
        for n in chosen
        if n["Resources"].get("CPU", 0) < needed
    ]
    if short:
        raise NodesUnready("\n".join(short))
    return chosen


def _placed(replicas: EnvReplicas, nodes: Iterable[Mapping[str, Any]]) -> list[Replica]:
    """Each replica's node, port and folder: ports counted up from ``replicas.port`` per IP, so Ray nodes sharing
    an address (several on one host) don't collide."""
    taken: Counter[str] = Counter()
    placed = []
    for node in nodes:
        ip = node["NodeManagerAddress"]
        for _ in range(replicas.per_node):
            port = replicas.port + taken[ip]
            taken[ip] += 1
            if port > 65535:
                raise NodesUnready(f"{ip} would need port {port} for its replicas: name a lower --port")
            folder = replicas.state_dir / replicas.name / f"{ip}-{port}"
            host = f"[{ip}]" if ":" in ip else ip
            placed.append(
                Replica(f"{replicas.name}/{ip}:{port}", node["NodeID"], ip, port, f"http://{host}:{port}", folder / LOG)
            )
    return placed


def _check_nodes(replicas: EnvReplicas, placed: Sequence[Replica], timeout_s: float) -> None:
    """Inspect every node that gets a replica, all at once. Raises NodesUnready with each node's problems, or when a
    node doesn't answer within ``timeout_s``."""
    ports: dict[str, list[int]] = {}
    for replica in placed:
        ports.setdefault(replica.node_id, []).append(replica.port)
    ips = {replica.node_id: replica.node_ip for replica in placed}
    inspect = {
        node_id: _on_node(checks.inspect_node, node_id).remote(
            str(replicas.env_python), str(replicas.bundle), node_ports, replicas.env_vars
        )
        for node_id, node_ports in ports.items()
    }
    ready, _ = ray.wait(list(inspect.values()), num_returns=len(inspect), timeout=timeout_s)
    found = []
    for node_id, reference in inspect.items():
        where = f"node {ips[node_id]} ({node_id})"
        if reference not in ready:
            found.append(f"{where} didn't run the check within {timeout_s:g} s")
            continue
        found += [
            f"{where}: {problem}"
            for problem in checks.problems(
                checks.NodeReport(**ray.get(reference)), str(replicas.env_python), str(replicas.bundle)
            )
        ]
    if found:
        raise NodesUnready("nothing was started:\n" + "\n".join(found))


def _started(replicas: EnvReplicas, placed: Sequence[Replica], deadline: float) -> tuple[Replica, ...]:
    """Start every replica and return them with the URL each reports once it serves. Raises ReplicaFailed for the
    first that dies while starting or doesn't serve by ``deadline``."""
    actor = ray.remote(EnvReplica)
    runtime_env = {"py_executable": str(replicas.env_python), "env_vars": dict(replicas.env_vars)}
    urls = {}
    for replica in placed:
        handle = actor.options(
            name=replica.name,
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=-1,
            max_task_retries=-1,
            num_cpus=replicas.cpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(replica.node_id, soft=False),
            runtime_env=runtime_env,
        ).remote(str(replicas.bundle), replica.port, replicas.max_concurrent_envs, str(replica.folder))
        urls[handle.url.remote()] = replica
    pending, served = list(urls), {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = urls[pending[0]]
            raise ReplicaFailed(_failure(late, f"didn't serve in time ({len(pending)} replica(s) still starting)"))
        replica = urls[ready[0]]
        try:
            served[replica.name] = ray.get(ready[0])
        except ray.exceptions.RayError:
            # Ray's error carries the replica's exception only when this process can import its class (agent-env's
            # can't be here); the replica's log has the traceback either way.
            raise ReplicaFailed(_failure(replica, "died while starting")) from None
        logger.info("%s serves at %s", replica.name, served[replica.name])
    return tuple(Replica(r.name, r.node_id, r.node_ip, r.port, served[r.name], r.log) for r in placed)


def _check_served(started: Sequence[Replica], deadline: float) -> None:
    """Raises ReplicaFailed, with the replica's log, when a replica's Task API doesn't answer this process by
    ``deadline`` or answers as something else than an env server, and ReplicasDiffer when the replicas fail the
    pool's check (``check_same_bundle``): one serves another env or other task ids than the first, or can't list
    them."""
    for replica in started:
        try:
            asyncio.run(_answering(replica.url, deadline))
        except ServerUnreachable as e:
            raise ReplicaFailed(_failure(replica, f"serves on its node, but not to this process: {e}")) from None
        except OpenEnvError as e:
            raise ReplicaFailed(_failure(replica, f"doesn't answer as an env server: {e}")) from None
    try:
        asyncio.run(check_same_bundle([replica.url for replica in started]))
    except ServerMismatch as e:
        raise ReplicasDiffer(str(e)) from None
    except ServerUnreachable as e:
        raise ReplicaFailed(f"a replica stopped answering while its tasks were listed: {e}") from None


async def _answering(url: str, deadline: float) -> None:
    """Return once the env server at ``url`` names its env to this process. Raises ServerUnreachable, the last
    try's, when it still can't be reached at ``deadline`` (``time.monotonic()``), and as ``OpenEnvServer.env_name``
    does when something else answers."""
    server = OpenEnvServer(url)
    while True:
        try:
            await server.env_name()
            return
        except ServerUnreachable:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(_ASK_AGAIN_S)


def _stop(name: str, *, timeout_s: float, strict: bool) -> tuple[str, ...]:
    """Stop every replica of ``name`` as ``down`` does; with ``strict``, raise ReplicaFailed for those that didn't
    stop cleanly, else (cleaning up after a failed ``up``) log them."""
    names = running_replicas(name)
    handles = {each: ray.get_actor(each, namespace=NAMESPACE) for each in names}
    stopping = {handle.stop.remote(): each for each, handle in handles.items()}
    ready, _ = ray.wait(list(stopping), num_returns=len(stopping), timeout=timeout_s)
    failed = []
    for reference, each in stopping.items():
        if reference not in ready:
            failed.append(f"{each} didn't stop within {timeout_s:g} s")
            continue
        try:
            ray.get(reference)
        except ray.exceptions.RayActorError:
            pass  # dead for good (it failed to start, or its node is gone): nothing of it runs to stop
        except ray.exceptions.RayError as e:
            failed.append(f"{each}: {e}")
    for handle in handles.values():
        ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while running_replicas(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left := running_replicas(name):
        failed.append(f"Ray still lists {', '.join(left)} after {timeout_s:g} s")
    if failed and strict:
        raise ReplicaFailed("not every replica stopped cleanly:\n" + "\n".join(failed))
    for each in failed:
        logger.warning("%s", each)
    if names:
        logger.info("stopped %d replica(s) of %s", len(names), name)
    return tuple(names)


def _failure(replica: Replica, what: str) -> str:
    """``replica`` ``what`` happened to it, with the end of its log, read on its node."""
    reading = _on_node(checks.read_tail, replica.node_id).remote(str(replica.log), _LOG_TAIL_CHARS)
    try:
        tail = ray.get(reading, timeout=30)
    except ray.exceptions.GetTimeoutError:
        tail = "(its node didn't hand the log over within 30 s)"
    where = f"replica {replica.name} on node {replica.node_ip} ({replica.node_id})"
    return f"{where} {what}; its log {replica.log} ends:\n{tail}"


def _on_node(function: Any, node_id: str) -> Any:
    """``function`` as a Ray task on node ``node_id``, reserving no CPU."""
    return ray.remote(function).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )


def _node_name(node: Mapping[str, Any]) -> str:
    return f"{node['NodeManagerAddress']} ({node['NodeID']})"
