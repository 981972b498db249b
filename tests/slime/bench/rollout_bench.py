"""What a slime rollout process spends per model turn with slime's real ``OpenAIAdapter`` in the loop: a benchmark,
not a test.

Each measured process is a worker playing the stand-in env's task (2 turns x 3 tool calls, 8 model turns) through
``slime_helper.generate.generate`` exactly as slime's rollout does: on slime's own background event loop, with the
adapter slime_helper serves on a thread of its own in the same process, from a launch parsed by slime's
``parse_args`` (Qwen3-0.6B's shape, Qwen3's tokenizer, thinking off, ``qwen25`` tool parser), as docs/PERFORMANCE.md's
tables have played it from the start. Only its neighbours are stand-ins, each in a process of its own: the frames env
server of ``//tests/unit/bench`` (``stand_in.py``) and an SGLang ``/generate`` answering at once with the task's
replies in Qwen3's tokens (``sglang_stand_in.py``).

For N = 1, 32, 256 and 1,024 episodes at once, it prints the CPU per model turn of the whole process
(``getrusage``), of the rollout loop's thread (chat_core's ``play``, slime_helper's glue and, for the episodes it plays
itself, the adapter's turns, handed to it in-process) and of the adapter's thread (its aiohttp server: the turns that
come over loopback HTTP), min and median over ``--runs`` workers, the model turns a second, and the peak RSS the
round added per episode in flight. ``--compare DIR`` runs, interleaved with these, workers whose packages come from
the checkout at DIR (another commit's worktree), so two clients are measured side by side in one run. Then it
measures what slime's ``call_sglang_generate`` spends on the ``aiohttp.ClientSession`` it opens and closes for every
``/generate`` call, against one session kept for all: a saving only a change to slime's code can make.

Run: ``./bazelw run //tests/slime/bench:rollout [-- --compare /path/to/other/checkout]``; ``-- --smoke`` plays a
few episodes once."""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import chat_core
import slime_helper
import stand_in

PACKAGES = ("chat_core", "slime_helper")
OWN_PACKAGES = tuple(str(Path(module.__file__).parent.parent) for module in (chat_core, slime_helper))
"""The folders this checkout's chat_core and slime_helper are imported from, which ``--compare`` swaps."""
CONCURRENCIES = (1, 32, 256, 1024)
ROUNDS = {1: 64, 32: 128, 256: 256, 1024: 1024}
"""Episodes a measured round plays at each concurrency."""
RUNS = 3
_TICKS = os.sysconf("SC_CLK_TCK")
_READY_S = 60.0


def script() -> list[Any]:
    """The replies that play the stand-in env's recorded task: per turn, its three tool calls one reply each, then
    its answer."""
    from test_support import text, tool_call

    steps: list[Any] = []
    for calls, reply in zip(stand_in.TOOL_CALLS, stand_in.REPLIES, strict=True):
        steps += [*(tool_call(name, arguments) for name, arguments in calls), text(reply)]
    return steps


def serve_sglang(checkpoint: Path, port_file: Path) -> None:
    """The stand-in SGLang, every session playing ``script()``, until killed. Its replies end without Qwen3's
    ``<|im_end|>``, which slime's adapter would leave in a reply's text and the frames env would refuse in the
    ``end_turn`` it doesn't hold."""
    from sglang_stand_in import StandInSGLang
    from slime.utils.processing_utils import load_tokenizer

    class Unterminated(StandInSGLang):
        def _answered(self, reply: Any, body: dict[str, Any], *placed: Any) -> dict[str, Any]:
            generated = super()._answered(reply, body, *placed)
            meta = generated["meta_info"]
            meta["output_token_logprobs"] = meta["output_token_logprobs"][:-1]
            generated["output_ids"] = generated["output_ids"][:-1]
            meta["completion_tokens"] -= 1
            return generated

    steps = script()
    with Unterminated(load_tokenizer(str(checkpoint), trust_remote_code=True), script_of=lambda _: steps) as server:
        port_file.with_suffix(".tmp").write_text(str(server.port))
        port_file.with_suffix(".tmp").rename(port_file)
        threading.Event().wait()


@contextmanager
def process(command: list[str], port_file: Path) -> Iterator[int]:
    """``command`` in a process of its own until the block ends; yields the port it wrote to ``port_file``."""
    child = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + _READY_S
        while not (port_file.exists() and port_file.read_text().strip()):
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[2]} didn't start (exit status {child.poll()})")
            time.sleep(0.05)
        yield int(port_file.read_text())
    finally:
        child.kill()
        child.wait()


def thread_cpu_s(thread: threading.Thread) -> float:
    """The CPU seconds ``thread`` has used, from the kernel's account of it."""
    fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_mb() -> float:
    """The process's resident memory now, in MB."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """The most resident memory the process has held so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class CollectorTime:
    """The CPU seconds CPython's garbage collector has spent so far (``seconds``), from its collections' callbacks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0
        gc.callbacks.append(self._noted)

    def _noted(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._began


def worker(options: argparse.Namespace) -> None:
    """Play rounds of episodes at each concurrency, a warm-up first, and print one JSON line of CPU per model
    turn: the process's, the rollout loop thread's and the adapter thread's."""
    from launch import THINKING_OFF, parse_slime_args, slime_command
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.async_utils import get_async_loop, run
    from slime.utils.types import Sample
    from slime_helper.generate import generate

    rows = [json.loads(line) for line in Path(options.rows).read_text().splitlines()]
    args = parse_slime_args(
        slime_command(
            Path(options.checkpoint),
            ("127.0.0.1", options.sglang_port),
            Path(options.rows),
            {},
            *THINKING_OFF,
            "--sglang-tool-call-parser",
            "qwen25",
        )
    )
    sampling = GenerateState(args).sampling_params.copy()

    async def played(episodes: int, concurrency: int) -> int:
        gate = asyncio.Semaphore(concurrency)

        async def one(number: int) -> int:
            row = rows[number % len(rows)]
            sample = Sample(index=number, prompt=row["messages"], metadata=row["metadata"])
            async with gate:
                samples = await generate(args, sample, sampling)
            outcome = samples[0].metadata["episode_outcome"]
            if not outcome["scored"]:
                raise RuntimeError(f"an episode wasn't scored: {outcome['flags']}")
            return outcome["model_calls"]

        return sum(await asyncio.gather(*(one(number) for number in range(episodes))))

    run(played(8, 8))
    loop_thread = get_async_loop()._thread
    adapter_thread = next(thread for thread in threading.enumerate() if thread.name == "slime-helper-adapter")
    measured = {}
    collector = CollectorTime()
    for concurrency in options.concurrency:
        began, resident = time.monotonic(), rss_mb()
        before = (process_cpu_s(), thread_cpu_s(loop_thread), thread_cpu_s(adapter_thread), collector.seconds)
        turns = run(played(options.episodes.get(concurrency, concurrency), concurrency))
        after = (process_cpu_s(), thread_cpu_s(loop_thread), thread_cpu_s(adapter_thread), collector.seconds)
        took = time.monotonic() - began
        per_turn = [(end - start) / turns * 1000 for start, end in zip(before, after, strict=True)]
        measured[concurrency] = dict(zip(("process", "loop", "adapter", "collector"), per_turn, strict=True))
        measured[concurrency]["turns_per_s"] = turns / took
        measured[concurrency]["rss_mb_per_episode"] = max(peak_rss_mb() - resident, 0.0) / concurrency
    print("RESULT " + json.dumps(measured), flush=True)


def session_cost(sglang_port: int, calls: int) -> dict[str, float]:
    """CPU ms per ``/generate`` call to the stand-in SGLang made as slime's ``call_sglang_generate`` makes it, in an
    ``aiohttp.ClientSession`` of its own, and in one session kept for every call."""
    import aiohttp

    url = f"http://127.0.0.1:{sglang_port}/generate"
    body = {"input_ids": list(range(400)), "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}

    sessions = itertools.count()

    def routed() -> dict[str, str]:
        return {"X-SMG-Routing-Key": f"session-cost-{next(sessions)}"}

    async def each_in_its_own() -> None:
        for _ in range(calls):
            async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=routed()) as answer:
                await answer.json(content_type=None)

    async def all_in_one() -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(calls):
                async with session.post(url, json=body, headers=routed()) as answer:
                    await answer.json(content_type=None)

    costs = {}
    for name, made in (("own_session", each_in_its_own), ("one_session", all_in_one)):
        asyncio.run(made())
        before = process_cpu_s()
        asyncio.run(made())
        costs[name] = (process_cpu_s() - before) / calls * 1000
    return costs


def measure(packages: list[str], common: list[str]) -> dict[int, dict[str, float]]:
    """One worker's figures, with chat_core and slime_helper from the folders ``packages``."""
    rest = [entry for entry in sys.path if entry and entry not in OWN_PACKAGES]
    done = subprocess.run(
        [sys.executable, __file__, "worker", *common],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(packages + rest)},
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"a worker failed (exit status {done.returncode}):\n{done.stderr[-3000:]}")
    return {int(key): value for key, value in json.loads(lines[-1].removeprefix("RESULT ")).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", type=Path, help="another checkout whose packages to measure side by side")
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--smoke", action="store_true", help="a few episodes at each concurrency, once")
    options = parser.parse_args()
    from test_support.checkpoint import QWEN3_0_6B, weightless_checkpoint

    runs = 1 if options.smoke else options.runs
    rounds = {concurrency: 4 for concurrency in CONCURRENCIES} if options.smoke else ROUNDS
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        checkpoint = weightless_checkpoint(folder / "Qwen3-0.6B", QWEN3_0_6B)
        with (
            stand_in.served("env", str(stand_in.FRAMES), "--tasks", "64") as env_url,
            process(
                [sys.executable, __file__, "sglang", str(checkpoint), str(folder / "sglang.port")],
                folder / "sglang.port",
            ) as sglang_port,
        ):
            import episode_overhead_bench

            rows_file = folder / "all.jsonl"
            metadata, _ = episode_overhead_bench.rows_of(env_url)
            rows_file.write_text("".join(json.dumps({"messages": [], "metadata": each}) + "\n" for each in metadata))
            common = [
                "--checkpoint", str(checkpoint), "--rows", str(rows_file), "--sglang-port", str(sglang_port),
                "--rounds", json.dumps(rounds),
            ]  # fmt: skip
            packages = {"this checkout": list(OWN_PACKAGES)}
            if options.compare is not None:
                packages[f"{options.compare}"] = [str(options.compare / "packages" / name) for name in PACKAGES]
            results: dict[str, list[dict[int, dict[str, float]]]] = {name: [] for name in packages}
            sessions = []
            for _ in range(runs):
                for name, folders in packages.items():
                    results[name].append(measure(folders, common))
                sessions.append(session_cost(sglang_port, 50 if options.smoke else 2000))
    report(results)
    report_sessions(sessions)


def report(results: dict[str, list[dict[int, dict[str, float]]]]) -> None:
    print("\nCPU ms per model turn of a slime rollout process, min / median of the runs")
    header = ["packages", "at once", "process", "rollout loop thread", "adapter thread", "of which the GC"]
    header.append("model turns/s")
    header.append("peak RSS MB/episode")
    rows = [header]
    for name, runs in results.items():
        for concurrency in sorted(runs[0]):
            cells = [name, str(concurrency)]
            for key in ("process", "loop", "adapter", "collector"):
                values = sorted(run[concurrency][key] for run in runs)
                cells.append(f"{values[0]:.2f} / {statistics.median(values):.2f}")
            cells.append(f"{statistics.median(run[concurrency]['turns_per_s'] for run in runs):.0f}")
            cells.append(f"{statistics.median(run[concurrency]['rss_mb_per_episode'] for run in runs):.3f}")
            rows.append(cells)
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    for row in rows:
        print("| " + " | ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) + " |")


def report_sessions(sessions: list[dict[str, float]]) -> None:
    print("\nCPU ms per /generate call, min / median of the runs")
    for name, said in (("own_session", "a session of its own (slime's code)"), ("one_session", "one session kept")):
        values = sorted(each[name] for each in sessions)
        print(f"{said}: {values[0]:.3f} / {statistics.median(values):.3f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["sglang"]:
        serve_sglang(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1:2] == ["worker"]:
        parser = argparse.ArgumentParser()
        parser.add_argument("worker")
        parser.add_argument("--checkpoint", required=True)
        parser.add_argument("--rows", required=True)
        parser.add_argument("--sglang-port", type=int, required=True)
        parser.add_argument("--rounds", type=json.loads, required=True)
        parsed = parser.parse_args()
        parsed.episodes = {int(key): value for key, value in parsed.rounds.items()}
        parsed.concurrency = sorted(parsed.episodes)
        worker(parsed)
    else:
        main()
