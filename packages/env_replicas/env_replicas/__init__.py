"""Env-server replicas on the trainer's own Ray cluster: ``up`` places ``per_node`` replicas of a bundle's
``build_app`` server on each node, each a detached actor on a fixed port that Ray restarts in place, on the env
server's own Python; ``down`` stops them and leaves nothing behind. ``launch_settings`` gives their URLs in the
forms the trainer helpers read a pool from. The command: ``python -m env_replicas up|down``.

It needs only the Ray of the environment it runs in (the trainer's) and chat_core, whose pool check it runs on the
replicas; agent-env runs in the replicas alone."""

from env_replicas.deployment import NAMESPACE, EnvReplicas, Replica, down, launch_settings, running_replicas, up
from env_replicas.errors import AlreadyUp, NodesUnready, ReplicaFailed, ReplicasDiffer, ReplicasError

__all__ = [
    "NAMESPACE",
    "AlreadyUp",
    "EnvReplicas",
    "NodesUnready",
    "Replica",
    "ReplicaFailed",
    "ReplicasDiffer",
    "ReplicasError",
    "down",
    "launch_settings",
    "running_replicas",
    "up",
]
