"""What ``up`` checks on each node before it starts anything: that the env server's Python is there, runs the
cluster's Ray version and Python minor and has agent-env and uvicorn, that the bundle folder is there, and that the
replicas' ports are free. Without Ray in that Python the replica's worker would crash at start and Ray would only
time out; a different Ray version isn't refused by Ray at all.

``inspect_node`` runs as a Ray task on the node, on the cluster's own Python, and answers with plain values (its
code travels by value, and so would a class of its own on the way back); ``problems`` turns its ``NodeReport``
into one line per thing that node lacks."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

_INSPECT_S = 60.0
_ENV_PYTHON_REPORT = """
import importlib.metadata, json, platform
report = {"python": platform.python_version()}
try:
    import ray
    report["ray"] = ray.__version__
except Exception as e:
    report["ray_error"] = f"{type(e).__name__}: {e}"
for name in ("agentenv-framework", "uvicorn"):
    try:
        report[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        report[name] = None
print(json.dumps(report))
"""


@dataclass(frozen=True)
class NodeReport:
    """What one node has: the cluster's Python and Ray versions there, what the env server's Python reported
    (``env``: its ``python`` and ``ray`` versions, or ``ray_error``, and the agentenv-framework and uvicorn versions,
    None when missing) or why it couldn't (``env_failure``), whether the bundle folder is there, and which of the
    replicas' ports another process holds."""

    python: str
    ray: str
    env: Mapping[str, str | None] | None
    env_failure: str | None
    bundle_found: bool
    ports_taken: tuple[int, ...]


def inspect_node(env_python: str, bundle: str, ports: Sequence[int], env_vars: Mapping[str, str]) -> dict[str, Any]:
    """This node's ``NodeReport`` as a dict, for the env server's Python ``env_python`` (run with ``env_vars`` added
    to its environment, as the replicas will be), ``bundle`` and the replicas' ``ports``."""
    env, failure = None, None
    if not os.access(env_python, os.X_OK):
        failure = "doesn't exist" if not os.path.exists(env_python) else "isn't executable"
    else:
        try:
            done = subprocess.run(
                [env_python, "-c", _ENV_PYTHON_REPORT],
                capture_output=True,
                text=True,
                timeout=_INSPECT_S,
                env={**os.environ, **env_vars},
                check=False,
            )
        except subprocess.TimeoutExpired:
            failure = f"didn't answer within {_INSPECT_S:g} s"
        else:
            if done.returncode == 0:
                env = json.loads(done.stdout.strip().splitlines()[-1])
            else:
                failure = f"exited {done.returncode}: {done.stderr.strip()[-500:]}"
    return {
        "python": platform.python_version(),
        "ray": ray.__version__,
        "env": env,
        "env_failure": failure,
        "bundle_found": Path(bundle).is_dir(),
        "ports_taken": tuple(port for port in ports if not port_free(port)),
    }


def problems(report: NodeReport, env_python: str, bundle: str) -> list[str]:
    """What the node of ``report`` lacks to run replicas of ``bundle`` on ``env_python``, one line each."""
    found = []
    if report.env_failure is not None:
        found.append(f"the env server's Python {env_python} {report.env_failure}")
    elif report.env is not None:
        env = report.env
        if "ray_error" in env:
            found.append(
                f"the env server's Python {env_python} has no Ray ({env['ray_error']}); the cluster runs Ray "
                f"{report.ray}: install ray=={report.ray} into it"
            )
        elif env["ray"] != report.ray:
            found.append(
                f"the env server's Python {env_python} has Ray {env['ray']}, the cluster runs Ray {report.ray}: "
                f"install ray=={report.ray} into it"
            )
        if _minor(env["python"]) != _minor(report.python):
            found.append(
                f"the env server's Python {env_python} is Python {env['python']}, the cluster's workers run "
                f"Python {report.python}: build it with Python {_minor(report.python)}"
            )
        for name in ("agentenv-framework", "uvicorn"):
            if env[name] is None:
                found.append(f"the env server's Python {env_python} lacks {name}")
    if not report.bundle_found:
        found.append(f"there is no bundle folder at {bundle}")
    found += [f"port {port} is taken" for port in report.ports_taken]
    return found


def read_tail(path: str, chars: int) -> str:
    """The last ``chars`` characters of the file at ``path`` on this node, or a line saying why there are none."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, os.path.getsize(path) - chars))
            return log.read().decode(errors="replace")
    except OSError as e:
        return f"(no log at {path}: {e.strerror})"


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def port_free(port: int) -> bool:
    """Whether nothing on this machine holds ``port``, on any address, at the moment of asking."""
    try:
        socket.create_server(("0.0.0.0", port)).close()
    except OSError:
        return False
    return True
