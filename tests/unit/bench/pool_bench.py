"""Episodes per second through a pool of 1, 2 and 3 env servers at the same concurrency: a benchmark, not a test.
It serves the sample bundle with agent-env's real server three times, each admitting ``--sessions`` episodes at once,
and plays the task ``played`` with a tool that waits (``wait_for_truck``, ``--tool-s`` seconds, standing for a
sandbox's I/O), from a model that answers at once, so the figure shows admission and routing rather than this
machine's cores. Per pool size it prints the episodes per second, the mean wall and capacity-wait time per
episode, and how the episodes spread over the servers. The replicas' benchmark (//tests/env_replicas:bench) measures
its pools with ``throughput`` and prints them with ``print_table``.

Run: ``./bazelw run //tests/unit/bench:pool -- [--episodes N] [--concurrency C] [--sessions S] [--tool-s T]``."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from chat_core import ChatEndpoint, EpisodeResult, Limits, play
from chat_core.prepare import write_rows
from test_support import ScriptedModel, serve_bundle, text, tool_call

REPLICAS = (1, 2, 3)


def played_metadata(url: str) -> dict[str, Any]:
    """The row metadata of the sample bundle's task ``played``, prepared from the server at ``url``."""
    with tempfile.TemporaryDirectory() as folder:
        rows_folder = Path(folder) / "rows"
        asyncio.run(write_rows(url, rows_folder, progress=False))
        rows = [json.loads(line) for line in (rows_folder / "all.jsonl").read_text().splitlines()]
    return next(row["metadata"] for row in rows if row["metadata"]["episode"]["task_name"] == "played")


def throughput(
    metadata: dict[str, Any], model: ScriptedModel, urls: Sequence[str], episodes: int, concurrency: int, label: str
) -> list[str]:
    """A pool of the servers at ``urls`` measured: after a warm-up episode on each server, ``episodes`` plays of
    ``metadata``'s task, ``concurrency`` at once, as the cells of a row: episodes per second, the mean wall and
    capacity-wait seconds of an episode, and the episodes each server played. Raises SystemExit when an episode
    isn't scored."""
    asyncio.run(_play_all(metadata, model, urls, len(urls), len(urls), f"warm-{label}"))
    results, elapsed = asyncio.run(_play_all(metadata, model, urls, episodes, concurrency, label))
    if unscored := [result for result in results if not result.scored]:
        raise SystemExit(f"{len(unscored)} episode(s) weren't scored, e.g. {unscored[0].flags}")
    spread = Counter(result.env_server for result in results)
    return [
        f"{len(results) / elapsed:.2f}",
        f"{statistics.mean(result.timings.wall_s for result in results):.2f}",
        f"{statistics.mean(result.timings.capacity_wait_s for result in results):.2f}",
        "/".join(str(spread[url]) for url in urls),
    ]


def print_table(table: list[list[str]]) -> None:
    """``table``'s rows, each column right-aligned to its widest cell."""
    widths = [max(len(row[column]) for row in table) for column in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))


async def _play_all(
    metadata: dict[str, Any], model: ScriptedModel, urls: Sequence[str], episodes: int, concurrency: int, label: str
) -> tuple[list[EpisodeResult], float]:
    """``episodes`` plays of ``metadata``'s task, at most ``concurrency`` at once, and the seconds they took."""
    gate = asyncio.Semaphore(concurrency)

    async def one(number: int) -> EpisodeResult:
        session = f"{label}-{number}"
        chat = ChatEndpoint(model.base_url + "/chat/completions", "bench", {"Authorization": f"Bearer {session}"})
        async with gate:
            return await play(metadata, chat, {}, Limits(), env_servers=urls)

    began = time.monotonic()
    results = await asyncio.gather(*(one(number) for number in range(episodes)))
    return results, time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=12, help="episodes played with each pool size")
    parser.add_argument("--concurrency", type=int, default=6, help="episodes played at once")
    parser.add_argument("--sessions", type=int, default=2, help="each server's max_concurrent_envs")
    parser.add_argument("--tool-s", type=float, default=4.0, help="seconds the tool waits")
    args = parser.parse_args()
    steps = [tool_call("wait_for_truck", {"seconds": args.tool_s}), text("The crate of pears is on shelf 9C.")]
    with ExitStack() as stack, ScriptedModel() as model:
        servers = [stack.enter_context(serve_bundle(max_concurrent_envs=args.sessions)) for _ in range(max(REPLICAS))]
        metadata = played_metadata(servers[0].url)
        model.script(steps)
        table = [["servers", "eps", "eps/s", "wall s/ep", "cap-wait s/ep", "episodes per server"]]
        for count in REPLICAS:
            urls = [server.url for server in servers[:count]]
            measured = throughput(metadata, model, urls, args.episodes, args.concurrency, f"r{count}")
            table.append([str(count), str(args.episodes), *measured])
    print(
        f"task 'played' with a {args.tool_s:g} s tool, {args.episodes} episodes, {args.concurrency} at once, "
        f"{args.sessions} sessions per server"
    )
    print_table(table)


if __name__ == "__main__":
    main()
