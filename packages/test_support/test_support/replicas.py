"""What the env replicas' tests and benchmark share: a Ray cluster of several nodes on this machine
(``ray.cluster_utils.Cluster``) with this process connected as its driver, consecutive free ports for a node's
replicas, and a replica's process found by its port. Imported only where Ray and psutil are installed (the
trainers' environments), never by the package's ``__init__``."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import ray
from env_replicas.checks import port_free
from ray.cluster_utils import Cluster

REPLICA_PORTS = range(10000, 20000)
"""Where a test's replicas serve: fixed ports, as a user's are, so below Linux's ephemeral ports (32768 up), which
any outgoing connection may be holding, and below agent-env's local sandboxes' (20000-30000)."""


@contextmanager
def loopback_cluster(nodes: int, cpus_each: int) -> Iterator[Cluster]:
    """``nodes`` Ray nodes on this machine, each declaring ``cpus_each`` CPUs to Ray, with this process connected.
    Ray's files, its address file included, go to a short private folder (``RAY_TMPDIR``: its sockets' paths must
    stay short, and no other cluster of this machine may be found or disturbed), and no idle workers are started
    ahead, which would only take the cores. Everything is shut down and removed on exit."""
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = ray_dir
    node = {"num_cpus": cpus_each, "include_dashboard": False}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **node,
            "_system_config": {"enable_worker_prestart": False, "prestart_worker_first_driver": False},
        },
    )
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if before is None:
            del os.environ["RAY_TMPDIR"]
        else:
            os.environ["RAY_TMPDIR"] = before
        shutil.rmtree(ray_dir, ignore_errors=True)


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports nothing holds, on any address, at the moment of asking, drawn from
    ``REPLICA_PORTS``. Raises RuntimeError when 100 draws find none."""
    for first in random.sample(range(REPLICA_PORTS.start, REPLICA_PORTS.stop - count), 100):
        if all(port_free(first + n) for n in range(count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports in {REPLICA_PORTS}")


def serving_pid(url: str) -> int:
    """The process listening on ``url``'s port. Raises ValueError unless exactly one does."""
    port = int(url.rsplit(":", 1)[1])
    listening = psutil.net_connections(kind="tcp")
    (pid,) = {c.pid for c in listening if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    return pid


def serves(url: str) -> bool:
    """Whether the env server at ``url`` answers its Task API now."""
    try:
        with urllib.request.urlopen(url + "/list_environments", timeout=5):
            return True
    except OSError:
        return False
