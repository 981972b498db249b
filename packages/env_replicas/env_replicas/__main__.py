"""``python -m env_replicas up NAME --bundle DIR --env-python PYTHON [...]`` and ``python -m env_replicas down NAME``:
the replicas of a bundle's env server on the running Ray cluster, brought up and down. ``up`` prints the replicas'
URLs in the forms the trainer helpers read (and with ``--write FILE`` writes the ``TRAINER_HELPERS_ENV_SERVERS=``
line to FILE); its progress and failures go to stderr, and it exits 1 on a failure."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import ray
from chat_core import ENV_SERVERS_VARIABLE

from env_replicas.deployment import EnvReplicas, down, launch_settings, up
from env_replicas.errors import ReplicasError


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="env_replicas: %(message)s", stream=sys.stderr)
    if args.command == "up":
        try:
            replicas = EnvReplicas(
                name=args.name,
                bundle=args.bundle,
                env_python=args.env_python,
                per_node=args.per_node,
                nodes=tuple(args.node),
                port=args.port,
                max_concurrent_envs=args.max_concurrent_envs,
                cpus=args.cpus,
                env_vars=dict(args.env),
                state_dir=args.state_dir,
            )
        except ValueError as e:
            _parser().error(str(e))
    try:
        ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as e:
        print(f"env_replicas: no Ray cluster at {args.address}: {e}", file=sys.stderr)
        return 1
    try:
        if args.command == "down":
            stopped = down(args.name, timeout_s=args.timeout)
            print(f"stopped {len(stopped)} replica(s) of {args.name}" if stopped else f"no replica of {args.name} runs")
            return 0
        started = up(replicas, timeout_s=args.timeout)
    except ReplicasError as e:
        print(f"env_replicas: {e}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    for replica in started:
        logging.info("%s at %s, its log at %s on that node", replica.name, replica.url, replica.log)
    urls = [replica.url for replica in started]
    if args.write:
        _write(args.write, f"{ENV_SERVERS_VARIABLE}={','.join(urls)}\n")
    print(launch_settings(urls))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m env_replicas", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("up", help="bring a bundle's env replicas up on the cluster")
    start.add_argument("name", help="the deployment's name, which `down` takes")
    start.add_argument("--bundle", type=Path, required=True, help="the bundle folder, the same path on every node")
    start.add_argument(
        "--env-python",
        type=Path,
        required=True,
        help="the env server's Python, the same path on every node, with agentenv-framework[openenv], uvicorn and "
        "the cluster's Ray",
    )
    start.add_argument("--per-node", type=int, default=1, help="replicas on each node (default 1)")
    start.add_argument(
        "--node",
        action="append",
        default=[],
        help="a node (IP or Ray node id) to place replicas on; repeat it; every alive node by default",
    )
    start.add_argument("--port", type=int, default=8000, help="the first replica's port on each node (default 8000)")
    start.add_argument("--max-concurrent-envs", type=int, default=8, help="episodes each replica admits at once (8)")
    start.add_argument("--cpus", type=float, default=1.0, help="CPUs each replica reserves in Ray (default 1)")
    start.add_argument(
        "--env",
        type=_variable,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable for the replicas' environment (AGENT_ENV_CONFIG, credentials); repeat it",
    )
    start.add_argument(
        "--state-dir",
        type=Path,
        default=Path("/tmp/env-replicas"),
        help="where each replica keeps its log, state and sandboxes on its node (default /tmp/env-replicas)",
    )
    start.add_argument("--write", type=Path, help=f"also write the {ENV_SERVERS_VARIABLE}=... line to this file")
    start.add_argument("--timeout", type=float, default=300.0, help="seconds for every replica to serve (300)")
    stop = commands.add_parser("down", help="stop a deployment's replicas and remove what they leave")
    stop.add_argument("name", help="the deployment's name")
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds for the replicas to stop (60)")
    for command in (start, stop):
        command.add_argument(
            "--address", default="auto", help="the Ray cluster's address (default: auto, the node this runs on)"
        )
    return parser


def _variable(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {text!r}")
    return name, value


def _write(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


if __name__ == "__main__":
    sys.exit(main())
