"""evaluate's own cost per model turn: a benchmark, not a test. A model that answers at once and a minimal stand-in
OpenEnv server (the real WebSocket protocol, one task: a tool call, then a reply that scores 1) run in a process of
their own, so only evaluate's work is counted: each concurrency runs ``chat_core.evaluate.evaluate``, JSONL writing
and progress bar on, in a fresh process, and reports its CPU seconds per model turn and the rise of its peak RSS
per episode in flight. The stand-ins' own CPU is not counted.

Run: ``./bazelw run //tests/unit/bench:evaluate`` (or ``PYTHONPATH=packages/chat_core:packages/test_support
.venv/bin/python tests/unit/bench/evaluate_bench.py``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chat_core.episode import ChatEndpoint, Limits
from chat_core.evaluate import EPISODES, Run, evaluate
from chat_core.rows import EpisodeRef
from test_support.loopback import LoopbackServer, Request
from websockets.asyncio.server import ServerConnection, serve

CONCURRENCIES = (1, 32, 256)
TASK = {"id": "bench/find", "name": "find"}
TOOL = {"name": "find_crate", "description": "Find a crate.", "input_schema": {"type": "object"}}


class _InstantModel(LoopbackServer):
    """An OpenAI chat endpoint answering at once: a tool call to a chat without a reply yet, else text."""

    def __init__(self) -> None:
        super().__init__(name="instant-model")

    def respond(self, request: Request) -> tuple[int, Any]:
        replied = any(message.get("role") == "assistant" for message in request.body["messages"])
        message: dict[str, Any] = {"role": "assistant", "content": "Shelf 9C." if replied else None}
        if not replied:
            call = {"id": "call_1", "type": "function", "function": {"name": "find_crate", "arguments": "{}"}}
            message["tool_calls"] = [call]
        return 200, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


def _observation(body: dict[str, Any], *, done: bool = False, metadata: dict[str, Any] | None = None) -> str:
    data = {"observation": body, "done": done, "reward": 1.0 if done else None, "metadata": metadata or {}}
    return json.dumps({"type": "observation", "data": data})


async def _episode(ws: ServerConnection) -> None:
    """One episode of the stand-in env's task, as agent-env's server speaks it."""
    async for raw in ws:
        message = json.loads(raw)
        if message["type"] == "reset":
            await ws.send(_observation({}, metadata={"task": TASK, "prompt": "Where are the pears?"}))
            continue
        step = message["data"]
        if step["type"] == "list_tools":
            await ws.send(_observation({"tools": [TOOL]}))
        elif step["tool_name"] == "end_turn":
            await ws.send(_observation({"result": {"data": "done"}}, done=True))
        else:
            await ws.send(_observation({"result": {"data": "shelf 9C"}}))


async def _serve() -> None:
    with _InstantModel() as model:
        async with serve(_episode, "127.0.0.1", 0, max_size=None, compression=None) as env:
            port = env.sockets[0].getsockname()[1]
            print(json.dumps({"env": f"http://127.0.0.1:{port}", "model": model.url + "/v1"}), flush=True)
            await asyncio.Future()


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _measure(env: str, model: str, concurrency: int, episodes: int) -> dict[str, float]:
    metadata = {
        "episode": {"split": "bench", "index": 0, "task_id": TASK["id"], "task_name": TASK["name"]},
        "tools": [],
        "server": {"url": env, "env_name": "bench"},
    }
    run = Run(ChatEndpoint(model + "/chat/completions", "bench"), {}, Limits(), concurrency)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run"
        before_rss = _rss_mb()
        cpu = time.process_time()
        began = time.monotonic()
        asyncio.run(
            evaluate([(EpisodeRef.from_metadata(metadata), metadata)], run, out, samples=episodes, resume=False)
        )
        cpu, wall = time.process_time() - cpu, time.monotonic() - began
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        records = [json.loads(line) for line in (out / EPISODES).read_text().splitlines()]
    turns = sum(record["episode_outcome"]["model_calls"] for record in records)
    scored = sum(record["episode_outcome"]["scored"] for record in records)
    return {
        "concurrency": concurrency,
        "episodes": len(records),
        "scored": scored,
        "turns": turns,
        "cpu_ms_per_turn": 1000 * cpu / turns,
        "wall_s": wall,
        "rss_mb_per_episode": max(0.0, peak_rss - before_rss) / concurrency,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--episodes",
        type=int,
        default=0,
        help="episodes per concurrency (default 4 per episode in flight, at least 200)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--measure", nargs=3, metavar=("ENV", "MODEL", "CONCURRENCY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve())
    elif args.measure:
        env, model, concurrency = args.measure
        episodes = args.episodes or max(200, 4 * int(concurrency))
        print(json.dumps(_measure(env, model, int(concurrency), episodes)))
    else:
        _compare_concurrencies(args.episodes)


def _compare_concurrencies(episodes: int) -> None:
    """Serve the stand-ins, measure each concurrency in a process of its own, and print the table."""
    me = [sys.executable, os.path.abspath(__file__)]
    stand_ins = subprocess.Popen([*me, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        urls = json.loads(stand_ins.stdout.readline())
        print("concurrency  episodes  turns  evaluate CPU ms/turn  peak RSS MB/episode in flight  wall s")
        for concurrency in CONCURRENCIES:
            measured = subprocess.run(
                [*me, "--measure", urls["env"], urls["model"], str(concurrency), "--episodes", str(episodes)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                check=True,
            )
            row = json.loads(measured.stdout)
            assert row["scored"] == row["episodes"], row
            print(
                f"{row['concurrency']:>11}  {row['episodes']:>8}  {row['turns']:>5}  {row['cpu_ms_per_turn']:>20.3f}  "
                f"{row['rss_mb_per_episode']:>29.3f}  {row['wall_s']:>6.1f}"
            )
    finally:
        stand_ins.terminate()
        stand_ins.wait()


if __name__ == "__main__":
    main()
