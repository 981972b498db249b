"""How much time chat_core's episode loop adds to an episode, beside the env server's own time: a benchmark, not a
test. It serves the sample bundle with agent-env's real server, answers every chat request at once from the scripted
model, and plays one task's episode N times at each concurrency, then prints a table.

Per episode, ``env`` is the time inside env calls (reset, list_tools, call_tool, end_turn: the server's own work plus
the loopback round trip), ``chat`` the time inside chat requests to a model that answers at once (the HTTP round trip
and JSON, on both sides), and ``loop`` what is left of the wall time: the loop's own work. Ratios are to ``env``.

Run: ``PYTHONPATH=packages/chat_core:packages/test_support .venv/bin/python
tests/unit/bench/episode_overhead_bench.py [--episodes N] [--task NAME]``."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from chat_core import ChatEndpoint, EpisodeResult, Limits, play
from chat_core.prepare import write_rows
from test_support import SCRIPTS, ScriptedModel, serve_bundle

CONCURRENCIES = (1, 8, 32)


async def _play_all(
    metadata: dict[str, Any], model: ScriptedModel, episodes: int, concurrency: int, label: str
) -> tuple[list[EpisodeResult], float]:
    """``episodes`` plays of ``metadata``'s task, at most ``concurrency`` at once, and the seconds they took."""
    gate = asyncio.Semaphore(concurrency)

    async def one(number: int) -> EpisodeResult:
        chat = ChatEndpoint(
            model.base_url + "/chat/completions", "bench", {"Authorization": f"Bearer {label}-{number}"}
        )
        async with gate:
            return await play(metadata, chat, {}, Limits())

    began = time.monotonic()
    results = await asyncio.gather(*(one(number) for number in range(episodes)))
    return results, time.monotonic() - began


def _row(concurrency: int, results: list[EpisodeResult], elapsed: float) -> list[str]:
    unscored = [result for result in results if not result.scored]
    if unscored:
        raise SystemExit(f"{len(unscored)} episode(s) weren't scored, e.g. {unscored[0].flags}")
    turns = sum(len(result.turns) for result in results)
    env = sum(result.timings.env_s for result in results)
    chat = sum(result.timings.model_s for result in results)
    loop = sum(
        result.timings.wall_s - result.timings.env_s - result.timings.model_s - result.timings.capacity_wait_s
        for result in results
    )
    wall = statistics.mean(result.timings.wall_s for result in results)
    return [
        str(concurrency),
        str(len(results)),
        f"{len(results) / elapsed:.2f}",
        f"{wall * 1000:.0f}",
        f"{env / len(results) * 1000:.0f}",
        f"{chat / len(results) * 1000:.1f}",
        f"{loop / len(results) * 1000:.2f}",
        f"{loop / turns * 1000:.2f}",
        f"{loop / env:.4f}",
        f"{chat / env:.4f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=32, help="episodes played at each concurrency")
    parser.add_argument("--task", default="played", choices=sorted(SCRIPTS), help="the sample task played")
    args = parser.parse_args()
    with serve_bundle(max_concurrent_envs=max(CONCURRENCIES)) as served, ScriptedModel() as model:
        with tempfile.TemporaryDirectory() as folder:
            asyncio.run(write_rows(served.url, Path(folder) / "rows", progress=False))
            rows = [json.loads(line) for line in (Path(folder) / "rows" / "all.jsonl").read_text().splitlines()]
        metadata = next(row["metadata"] for row in rows if row["metadata"]["episode"]["task_name"] == args.task)
        model.script(SCRIPTS[args.task])
        asyncio.run(_play_all(metadata, model, 2, 2, "warm-up"))
        table = [
            [
                "conc",
                "eps",
                "eps/s",
                "wall ms",
                "env ms",
                "chat ms",
                "loop ms/ep",
                "loop ms/turn",
                "loop/env",
                "chat/env",
            ]
        ]
        for concurrency in CONCURRENCIES:
            results, elapsed = asyncio.run(_play_all(metadata, model, args.episodes, concurrency, f"c{concurrency}"))
            table.append(_row(concurrency, results, elapsed))
    widths = [max(len(row[column]) for row in table) for column in range(len(table[0]))]
    print(f"task {args.task!r}, {args.episodes} episodes per concurrency; per-episode means")
    for row in table:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
