"""What env replicas on Ray cost and give, on a 2-node Ray cluster on this machine: a benchmark, not a test.

- ``up`` of 2 replicas (one a node), from the call to both serving and checked, then ``down``; ``--repeats`` times.
- A replica's restart: SIGKILL of its process to its Task API answering again at the same URL, and Ray's part of
  it (to the new instance's first log line; the rest is importing agent-env and building the app); ``--repeats``
  kills.
- Episodes per second through chat_core's pool with 1, 2 and 4 replicas (1 on one node, 1 on each, 2 on each), each
  admitting ``--sessions`` episodes at once: ``--episodes`` plays of the sample bundle's task ``played`` with a tool
  that waits (``wait_for_truck``, ``--tool-s`` seconds, standing for a sandbox's I/O), ``--concurrency`` at once,
  from a model that answers at once, so the figure shows admission and routing more than this machine's cores;
  measured as the pool's benchmark (//tests/unit/bench:pool) measures its pools.

Every replica declares 1 CPU to Ray; the two nodes declare 2 each and share this machine's cores, as the figures say.
Run: ``./bazelw run //tests/env_replicas:bench -- [--repeats N] [--episodes N] [--concurrency C] [--sessions S]
[--tool-s T]``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import ray
import test_support
from env_replicas import EnvReplicas, down, up
from pool_bench import played_metadata, print_table, throughput
from test_support import SAMPLE_BUNDLE, ScriptedModel, text, tool_call
from test_support.replicas import free_ports, loopback_cluster, serves, serving_pid
from test_support.trainer_env import env_server_environment

NODE_CPUS = 2
REPLICAS = (1, 2, 4)
_WAIT_S = 180.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="ups and kills timed (3)")
    parser.add_argument("--episodes", type=int, default=24, help="episodes played with each replica count (24)")
    parser.add_argument("--concurrency", type=int, default=8, help="episodes played at once (8)")
    parser.add_argument("--sessions", type=int, default=2, help="each replica's max_concurrent_envs (2)")
    parser.add_argument("--tool-s", type=float, default=2.0, help="seconds the tool waits (2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="env-replicas-bench-") as folder, ScriptedModel() as model:
        state = Path(folder)
        config = state / "agent-env.toml"
        config.write_text('[envs]\nimpls = ["test_support.local_tools_env:LocalToolsEnv"]\n')
        base = EnvReplicas(
            name="bench",
            bundle=SAMPLE_BUNDLE,
            env_python=env_server_environment(),
            port=free_ports(4),
            max_concurrent_envs=args.sessions,
            env_vars={"AGENT_ENV_CONFIG": str(config), "PYTHONPATH": str(Path(test_support.__file__).parent.parent)},
            state_dir=state,
        )
        with loopback_cluster(nodes=2, cpus_each=NODE_CPUS):
            nodes = sorted(node["NodeID"] for node in ray.nodes())
            ups, downs = _ups(base, args.repeats)
            restarts, ray_parts = _restarts(base, args.repeats)
            measured = _throughputs(base, nodes, model, args)
    print(
        f"2 Ray nodes declaring {NODE_CPUS} CPUs each on a machine of {os.cpu_count()} cores; each replica reserves "
        "1 CPU"
    )
    print(f"up of 2 replicas, s: {_spread(ups)}; down: {_spread(downs)}")
    print(f"restart (SIGKILL to serving at the same URL), s: {_spread(restarts)}; Ray's part: {_spread(ray_parts)}")
    print(
        f"task 'played' with a {args.tool_s:g} s tool, {args.episodes} episodes, {args.concurrency} at once, "
        f"{args.sessions} sessions per replica"
    )
    print_table([["replicas", "eps/s", "wall s/ep", "cap-wait s/ep", "episodes per replica"], *measured])


def _ups(base: EnvReplicas, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of ``up`` and of ``down`` of one replica a node, ``repeats`` times."""
    ups, downs = [], []
    for _ in range(repeats):
        began = time.monotonic()
        up(base)
        ups.append(time.monotonic() - began)
        began = time.monotonic()
        down(base.name)
        downs.append(time.monotonic() - began)
    return ups, downs


def _restarts(base: EnvReplicas, repeats: int) -> tuple[list[float], list[float]]:
    """Per kill of a replica (``repeats`` of them): seconds from its SIGKILL to its Task API answering again at its
    URL, and Ray's part of them, to the first line the new instance logs."""
    (replica, _) = up(base)
    serving, ray_part = [], []
    try:
        for _ in range(repeats):
            logged = replica.log.read_text().count("restarted by Ray")
            os.kill(serving_pid(replica.url), signal.SIGKILL)
            killed = time.time()
            while not serves(replica.url):
                if time.time() - killed > _WAIT_S:
                    raise SystemExit(f"{replica.url} didn't serve again within {_WAIT_S:g} s")
                time.sleep(0.05)
            serving.append(time.time() - killed)
            ray_part.append(_restart_logged(replica.log, logged) - killed)
    finally:
        down(base.name)
    return serving, ray_part


def _restart_logged(log: Path, earlier: int) -> float:
    """When the restart after the ``earlier`` ones logged its first line, as a time.time()."""
    lines = [line for line in log.read_text().splitlines() if "restarted by Ray" in line]
    stamp = lines[earlier].split(" [env_replicas]")[0]
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _throughputs(
    base: EnvReplicas, nodes: list[str], model: ScriptedModel, args: argparse.Namespace
) -> list[list[str]]:
    """A row per replica count: episodes per second, mean wall and capacity-wait seconds an episode, the spread."""
    model.script([tool_call("wait_for_truck", {"seconds": args.tool_s}), text("The crate of pears is on shelf 9C.")])
    placements = {1: (1, nodes[:1]), 2: (1, nodes), 4: (2, nodes)}
    rows = []
    for count in REPLICAS:
        per_node, on = placements[count]
        replicas = up(dataclasses.replace(base, per_node=per_node, nodes=tuple(on)))
        try:
            urls = [replica.url for replica in replicas]
            metadata = played_metadata(urls[0])
            rows.append([str(count), *throughput(metadata, model, urls, args.episodes, args.concurrency, f"r{count}")])
        finally:
            down(base.name)
    return rows


def _spread(seconds: list[float]) -> str:
    return (
        f"min {min(seconds):.1f}, median {statistics.median(seconds):.1f}, max {max(seconds):.1f} ({len(seconds)} runs)"
    )


if __name__ == "__main__":
    main()
