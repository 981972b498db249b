"""Every way bringing env replicas up or down can fail, each a subclass of ``ReplicasError``:

ReplicasError
├── AlreadyUp        a deployment of that name has replicas on the cluster; nothing was started
├── NodesUnready     a node can't run its replicas (env Python, Ray or Python version, bundle, port, CPUs);
│                    found before anything was started
├── ReplicaFailed    a replica didn't come up, or didn't stop; the message ends with its log
└── ReplicasDiffer   the replicas fail the pool's check (chat_core's ServerMismatch): they serve different envs or
                     task ids, or one can't list them; they were stopped again
"""

from __future__ import annotations


class ReplicasError(Exception):
    """Env replicas can't be brought up or down; the message says why and what to do."""


class AlreadyUp(ReplicasError):
    """The cluster already runs replicas of a deployment of this name."""


class NodesUnready(ReplicasError):
    """One or more nodes can't run their replicas; the message names each node and what it lacks."""


class ReplicaFailed(ReplicasError):
    """A replica didn't come up in time, died while starting, or didn't stop when asked."""


class ReplicasDiffer(ReplicasError):
    """Two replicas serve different envs, splits or task ids, or one can't list them, so the pool would refuse
    them; the message is the pool's."""
