"""evaluate's own cost per model turn: a benchmark, not a test. A model that answers at once and a minimal stand-in
OpenEnv server (the real WebSocket protocol, one task: a tool call, then a reply that scores 1) run in a process of
their own, so only evaluate's work is counted: each concurrency runs ``chat_core.evaluate.run.evaluate``, JSONL writing
and progress bar on, over one sample of as many rows as episodes, in a fresh process, ``--repeats`` times, and
reports the min and median of its CPU seconds per model turn and the rise of its peak RSS per episode in flight.
The stand-ins' own CPU is not counted.

What is counted is a run's steady work, its pre-flight request and summary included. Before it each process plays
a short warm-up run, whose CPU (the first chat client, code run for the first time) is shown apart as the one-off
cost; the RSS after it, and after the bench's own rows are built, is the baseline the peak's rise is taken from.
Importing is counted in neither.

Run: ``./bazelw run //tests/unit/bench:evaluate`` (or ``PYTHONPATH=packages/chat_core:packages/test_support
.venv/bin/python tests/unit/bench/evaluate_bench.py``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chat_core import ChatEndpoint, Limits
from chat_core.episode_ref import EpisodeRef
from chat_core.evaluate.records import EPISODES
from chat_core.evaluate.run import Run, evaluate
from test_support.loopback import LoopbackServer, Request
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

CONCURRENCIES = (1, 32, 256)
_WARM_UP = 4
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
    """One episode of the stand-in env's task, as agent-env's server speaks it, until the client closes the session
    or drops it (chat_core drops the sessions it parked when its event loop ends)."""
    with contextlib.suppress(ConnectionClosed):
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


def _rows(env: str, count: int) -> list[tuple[EpisodeRef, dict[str, Any]]]:
    rows = []
    for index in range(count):
        metadata = {
            "episode": {"split": "bench", "index": index, "task_id": TASK["id"], "task_name": TASK["name"]},
            "tools": [],
            "server": {"url": env, "env_name": "bench"},
        }
        rows.append((EpisodeRef.from_metadata(metadata), metadata))
    return rows


def _evaluate(
    rows: list[tuple[EpisodeRef, dict[str, Any]]], model: str, concurrency: int
) -> tuple[float, float, float, list[dict[str, Any]]]:
    """The CPU and wall seconds of one evaluate run of ``rows``, the peak RSS in MB by its end, and its records
    (read back after the peak is taken)."""
    run = Run(ChatEndpoint(model + "/chat/completions", "bench"), {}, Limits(), concurrency)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run"
        cpu = time.process_time()
        began = time.monotonic()
        asyncio.run(evaluate(rows, run, out, samples=1, resume=False))
        cpu, wall = time.process_time() - cpu, time.monotonic() - began
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        records = [json.loads(line) for line in (out / EPISODES).read_text().splitlines()]
    return cpu, wall, peak_rss, records


def _measure(env: str, model: str, concurrency: int, episodes: int) -> dict[str, float]:
    one_off, *_ = _evaluate(_rows(env, _WARM_UP), model, 1)
    rows = _rows(env, episodes)
    before_rss = _rss_mb()
    cpu, wall, peak_rss, records = _evaluate(rows, model, concurrency)
    turns = sum(record["episode_outcome"]["model_calls"] for record in records)
    scored = sum(record["episode_outcome"]["scored"] for record in records)
    return {
        "concurrency": concurrency,
        "episodes": len(records),
        "scored": scored,
        "turns": turns,
        "cpu_ms_per_turn": 1000 * cpu / turns,
        "warm_up_cpu_ms": 1000 * one_off,
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
    parser.add_argument("--repeats", type=int, default=3, help="runs per concurrency, each in a fresh process")
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
        _compare_concurrencies(args.episodes, args.repeats)


def _compare_concurrencies(episodes: int, repeats: int) -> None:
    """Serve the stand-ins, measure each concurrency ``repeats`` times, each in a process of its own, and print the
    table: the min and median CPU per turn over the repeats, the median of the rest."""
    me = [sys.executable, os.path.abspath(__file__)]
    stand_ins = subprocess.Popen([*me, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        urls = json.loads(stand_ins.stdout.readline())
        print(
            "concurrency  episodes  turns  evaluate CPU ms/turn min  median  warm-up CPU ms  "
            "peak RSS MB/episode in flight  wall s"
        )
        for concurrency in CONCURRENCIES:
            rows = []
            for _ in range(repeats):
                measured = subprocess.run(
                    [*me, "--measure", urls["env"], urls["model"], str(concurrency), "--episodes", str(episodes)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    check=True,
                )
                rows.append(row := json.loads(measured.stdout))
                assert row["scored"] == row["episodes"], row
            cpu, warm_up, rss, wall = (
                [row[name] for row in rows]
                for name in ("cpu_ms_per_turn", "warm_up_cpu_ms", "rss_mb_per_episode", "wall_s")
            )
            print(
                f"{concurrency:>11}  {rows[0]['episodes']:>8}  {rows[0]['turns']:>5}  {min(cpu):>24.3f}  "
                f"{statistics.median(cpu):>6.3f}  {statistics.median(warm_up):>14.1f}  "
                f"{statistics.median(rss):>29.3f}  {statistics.median(wall):>6.1f}"
            )
    finally:
        stand_ins.terminate()
        stand_ins.wait()


if __name__ == "__main__":
    main()
