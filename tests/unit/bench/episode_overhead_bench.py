"""What chat_core's episode loop costs the process that drives it: a benchmark, not a test. The env server and the
model are fast stand-ins (``stand_in``), each in a process of its own, so the driver's CPU (``getrusage``) is the
loop's own: ``play`` with its env session and chat client. Each episode is 2 turns x 3 tool calls (4 model turns).

It prints, for 1, 32, 256 and 1,024 concurrent episodes with a model that answers at once, the driver's CPU per
model turn (min and median of 3 runs) in two rounds of episodes played one after the other in one event loop: the
first round opens a WebSocket session and a chat connection for each episode playing at once (and pays for the
loop's shutdown), the second starts on the sessions the first parked, as a rollout's or an evaluate's episodes
beyond the first N do. Then the loop's own wall time per turn from ``EpisodeResult.timings`` (wall - env - model -
capacity wait); then 1,024 episodes with 2 s model turns, one round, with the cores the driver used and the rise of
its peak RSS per episode in flight (median of the runs, each from the RSS before it); then
``prepare``'s tasks per second from a stand-in of 10,000 tasks at two ``--concurrency`` values.

Run: ``./bazelw run //tests/unit/bench:episode_overhead [-- --smoke]``; ``--smoke`` runs every part on a few
episodes, once. ``--record`` plays the stand-in's task once on agent-env's real server through a relay and writes
what the server answered to ``frames.json`` (then copy it into the source tree)."""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import stand_in
from chat_core import ChatEndpoint, EpisodeResult, Limits, play
from chat_core.prepare import write_rows
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

BUNDLE = stand_in.BUNDLE
CONCURRENCIES = (1, 32, 256, 1024)
SLOW_TURN_S = 2.0
PREPARE_TASKS = 10_000
PREPARE_CONCURRENCIES = (8, 64)
RUNS = 3


@dataclass(frozen=True)
class Run:
    """One run of ``episodes`` episodes: the driver's CPU and wall seconds, and the episodes' results."""

    cpu_s: float
    wall_s: float
    results: list[EpisodeResult]

    @property
    def model_turns(self) -> int:
        return sum(turn.model_calls for result in self.results for turn in result.turns)

    @property
    def cpu_ms_per_turn(self) -> float:
        return self.cpu_s / self.model_turns * 1000

    @property
    def own_ms_per_turn(self) -> float:
        """The loop's own wall time per model turn, as the episodes' timings account for it."""
        own = sum(
            result.timings.wall_s - result.timings.env_s - result.timings.model_s - result.timings.capacity_wait_s
            for result in self.results
        )
        return own / self.model_turns * 1000


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measured(work: Callable[[], Any]) -> tuple[Any, float, float]:
    """What ``work()`` returned, and the CPU and wall seconds this process spent on it."""
    cpu, wall = cpu_s(), time.monotonic()
    value = work()
    return value, cpu_s() - cpu, time.monotonic() - wall


async def measured_async(work: Awaitable[Any]) -> tuple[Any, float, float]:
    """What awaiting ``work`` gave, and the CPU and wall seconds this process spent meanwhile."""
    cpu, wall = cpu_s(), time.monotonic()
    value = await work
    return value, cpu_s() - cpu, time.monotonic() - wall


async def play_all(rows: list[dict[str, Any]], model_url: str, episodes: int, concurrency: int) -> list[EpisodeResult]:
    """``episodes`` episodes of ``rows``' tasks in turn, at most ``concurrency`` at once, each its own chat session."""
    gate = asyncio.Semaphore(concurrency)

    async def one(number: int) -> EpisodeResult:
        chat = ChatEndpoint(model_url + "/v1/chat/completions", "bench", {"Authorization": f"Bearer ep-{number}"})
        async with gate:
            return await play(rows[number % len(rows)], chat, {}, Limits())

    return await asyncio.gather(*(one(number) for number in range(episodes)))


def run(rows: list[dict[str, Any]], model_url: str, episodes: int, concurrency: int, rounds: int = 1) -> list[Run]:
    """``rounds`` rounds of ``episodes`` episodes, one after the other in one fresh event loop. The first round's
    run counts whatever the loop sets up once (a WebSocket session and a chat connection per episode playing at once)
    and the loop's shutdown; each later round starts on the sessions the one before parked, as the episodes of a
    rollout or an evaluate beyond the first ``concurrency`` do. Raises SystemExit when an episode isn't scored: the
    benchmark measures only episodes played through."""
    later: list[Run] = []

    async def played() -> list[EpisodeResult]:
        first = await play_all(rows, model_url, episodes, concurrency)
        for _ in range(rounds - 1):
            results, cpu, wall = await measured_async(play_all(rows, model_url, episodes, concurrency))
            later.append(Run(cpu, wall, results))
        return first

    first, cpu, wall = measured(lambda: asyncio.run(played()))
    runs = [Run(cpu - sum(each.cpu_s for each in later), wall - sum(each.wall_s for each in later), first), *later]
    for each in runs:
        if unscored := [result for result in each.results if not result.scored]:
            raise SystemExit(f"{len(unscored)} of {episodes} episode(s) weren't scored, e.g. {unscored[0].flags}")
    return runs


def rows_of(url: str, concurrency: int = 64) -> tuple[list[dict[str, Any]], float]:
    """The metadata of the server's rows in split ``all``, and the seconds ``prepare`` took to write them."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows"
        began = time.monotonic()
        asyncio.run(write_rows(url, out, concurrency=concurrency, progress=False))
        took = time.monotonic() - began
        return [json.loads(line)["metadata"] for line in (out / "all.jsonl").read_text().splitlines()], took


def print_table(title: str, table: list[list[str]]) -> None:
    widths = [max(len(row[column]) for row in table) for column in range(len(table[0]))]
    print(f"\n{title}")
    for row in table:
        print("| " + " | ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) + " |")


def episodes_table(frames: Path, concurrencies: tuple[int, ...], runs: int, least: int) -> None:
    table = [
        [
            "episodes at once",
            "episodes a round",
            "round 1 CPU ms/turn min",
            "median",
            "round 2 CPU ms/turn min",
            "median",
            "loop's own wall ms/turn",
            "episodes/s",
        ]
    ]
    with stand_in.served("env", str(frames), "--tasks", "64") as env_url, stand_in.served("model") as model_url:
        rows, _ = rows_of(env_url)
        run(rows, model_url, 8, 8)
        for concurrency in concurrencies:
            episodes = max(concurrency, least)
            done = [run(rows, model_url, episodes, concurrency, rounds=2) for _ in range(runs)]
            first = sorted(each.cpu_ms_per_turn for each, _ in done)
            second = sorted(each.cpu_ms_per_turn for _, each in done)
            table.append(
                [
                    str(concurrency),
                    str(episodes),
                    f"{first[0]:.2f}",
                    f"{statistics.median(first):.2f}",
                    f"{second[0]:.2f}",
                    f"{statistics.median(second):.2f}",
                    f"{statistics.median(each.own_ms_per_turn for rounds in done for each in rounds):.3f}",
                    f"{statistics.median(episodes / each.wall_s for rounds in done for each in rounds):.0f}",
                ]
            )
    print_table("A model answering at once: the driver's own CPU per model turn", table)


def memory_kib(field: str) -> int:
    """A field of this process's ``/proc/self/status`` (``VmRSS``, ``VmHWM``: its peak since ``reset_peak``), KiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def reset_peak() -> None:
    """Start this process's peak RSS (``VmHWM``) over from its RSS now."""
    Path("/proc/self/clear_refs").write_text("5")


def slow_table(frames: Path, episodes: int, turn_s: float, runs: int) -> None:
    table = [
        [
            "episodes at once",
            "model turn s",
            "CPU ms/turn",
            "cores used",
            "episode s (mean)",
            "ideal s",
            "peak RSS MB/ep",
        ]
    ]
    with (
        stand_in.served("env", str(frames), "--tasks", "64") as env_url,
        stand_in.served("model", "--delay", str(turn_s)) as model_url,
    ):
        rows, _ = rows_of(env_url)
        done, rises = [], []
        for _ in range(runs):
            reset_peak()
            before = memory_kib("VmRSS")
            done.append(run(rows, model_url, episodes, episodes)[0])
            rises.append((memory_kib("VmHWM") - before) / 1024 / episodes)
    best = min(done, key=lambda each: each.cpu_s)
    turns = best.model_turns // episodes
    table.append(
        [
            str(episodes),
            f"{turn_s:g}",
            f"{best.cpu_ms_per_turn:.2f}",
            f"{best.cpu_s / best.wall_s:.3f}",
            f"{statistics.mean(result.timings.wall_s for result in best.results):.2f}",
            f"{turns * turn_s:g}",
            f"{statistics.median(rises):.3f}",
        ]
    )
    print_table(f"{episodes} episodes with {turn_s:g} s model turns (the run of least CPU of {runs})", table)


def prepare_table(frames: Path, tasks: int, concurrencies: tuple[int, ...]) -> None:
    table = [["tasks", "--concurrency", "tasks/s", "driver CPU ms/task"]]
    with stand_in.served("env", str(frames), "--tasks", str(tasks)) as env_url:
        for concurrency in concurrencies:
            (_, took), cpu, _ = measured(lambda concurrency=concurrency: rows_of(env_url, concurrency))
            table.append([str(tasks), str(concurrency), f"{tasks / took:.0f}", f"{cpu / tasks * 1000:.3f}"])
    print_table("prepare from a stand-in Task API and WebSocket", table)


async def _relay(upstream: str, exchange: list[list[Any]]) -> Any:
    """A WebSocket server relaying each message to ``upstream`` and its answer back, noting both in ``exchange``."""

    async def relay(client: ServerConnection) -> None:
        async with connect(upstream, proxy=None, max_size=None) as server:
            async for message in client:
                await server.send(message)
                answer = await server.recv()
                exchange.append([json.loads(message), json.loads(answer)])
                await client.send(answer)

    return await serve(relay, stand_in.HOST, 0)


def record(out: Path) -> None:
    """Play the stand-in's task once on the real server, through a relay noting every frame, and write them."""
    from test_support import serve_bundle

    with serve_bundle(BUNDLE) as real, stand_in.served("model") as model_url:
        rows, _ = rows_of(real.url)
        (metadata,) = rows
        (task,) = real.tasks()
        exchange: list[list[Any]] = []

        async def played() -> EpisodeResult:
            relay = await _relay(real.ws_url, exchange)
            port = next(iter(relay.sockets)).getsockname()[1]
            relayed = {**metadata, "server": {**metadata["server"], "url": f"http://{stand_in.HOST}:{port}"}}
            try:
                return await play(relayed, ChatEndpoint(model_url + "/v1/chat/completions", "bench"), {}, Limits())
            finally:
                relay.close()
                await relay.wait_closed()

        result = asyncio.run(played())
    if not result.scored:
        raise SystemExit(f"the real server didn't score the recorded episode: {result.flags}")
    recorded = json.dumps({"env_name": real.env_name, "task": task, "exchange": exchange}, indent=1)
    out.write_text(recorded.replace(str(BUNDLE), stand_in.BUNDLE_PLACEHOLDER) + "\n")
    print(f"recorded {len(exchange)} frames, reward {result.reward}, in {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every part on a few episodes, once: a check it runs")
    parser.add_argument("--record", type=Path, metavar="FRAMES", help="record the real server's frames to FRAMES")
    args = parser.parse_args(argv)
    if args.record:
        return record(args.record)
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    if args.smoke:
        episodes_table(stand_in.FRAMES, (1, 4), 1, 2)
        slow_table(stand_in.FRAMES, 4, 0.05, 1)
        prepare_table(stand_in.FRAMES, 50, (4,))
        return None
    print(f"python {sys.version.split()[0]}; driver CPU by getrusage, min/median of {RUNS} runs")
    episodes_table(stand_in.FRAMES, CONCURRENCIES, RUNS, 32)
    slow_table(stand_in.FRAMES, CONCURRENCIES[-1], SLOW_TURN_S, RUNS)
    prepare_table(stand_in.FRAMES, PREPARE_TASKS, PREPARE_CONCURRENCIES)
    return None


if __name__ == "__main__":
    main()
