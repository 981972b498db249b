"""The env replicas' tier: ``env_replicas`` on a 2-node Ray cluster on loopback (``ray.cluster_utils.Cluster``),
in the slime environment's Ray, with the replicas on the env server's own environment and the sample bundle served
by agent-env's real ``build_app``; the episodes are played by chat_core's pool with the scripted model.

Run it inside the slime environment, with the env server's environment built:

    PYTHONPATH=third_party python3.11 tools/envs/build_env.py slime env-server
    PYTHONPATH=packages/chat_core:packages/env_replicas:packages/test_support:third_party:tools/envs \\
        .venvs/slime/bin/python -m pytest tests/env_replicas

Without slime's pins, outside the slime environment of the current spec, or without the env server's environment,
it fails at once saying how to fix it. A Python with agent-env but no Ray, for the refusal test, is the one
``ENV_SERVER_PYTHON`` names, by default the development virtualenv's.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray.cluster_utils import Cluster
from test_support.replicas import loopback_cluster
from test_support.trainer_env import TierUnready, env_server_environment, require_tier

try:
    RAYLESS_PYTHON = require_tier("slime", ["slime", "megatron-lm"])
    ENV_PYTHON = env_server_environment()
except TierUnready as unready:
    raise pytest.UsageError(str(unready)) from None

NODE_CPUS = 2
"""What each of the two nodes declares to Ray; both share this machine's cores."""


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """Two Ray nodes on this machine, with this process connected as a driver."""
    with loopback_cluster(nodes=2, cpus_each=NODE_CPUS) as started:
        yield started


@pytest.fixture(scope="session")
def state_dir() -> Iterator[Path]:
    """Where the replicas keep their logs, state and sandboxes, as ``up --state-dir`` names it."""
    with tempfile.TemporaryDirectory(prefix="env-replicas-") as folder:
        yield Path(folder)
