"""What slime's weight updates cost a fully-async rollout with this helper: a benchmark, not a test.

Each measured process runs slime's own fully-async worker through ``slime_helper.generate_rollout_fully_async``, on
slime's own data source, with the adapter slime_helper serves, from a launch parsed by slime's ``parse_args`` (Qwen3's
tokenizer, thinking off, 4 episodes in flight, groups of 2, 2 groups a rollout call). The env is the frames stand-in
of ``//tests/unit/bench`` in a process of its own (2 turns x 3 tool calls, 8 model calls an episode); SGLang is the
slime tier's stand-in (``sglang_stand_in``) in the measured process, generating a token every ``seconds_per_token``,
set so that an episode's generation takes 0.3, 1 or 3 times the interval between weight updates (``--interval``).
A thread does what slime's update does every interval: pause generation (abort mode), flush the cache, a 0.3 s
transfer under the next weight version, continue.

For each episode length it prints, for this checkout and for ``--compare DIR``'s packages (another commit's
checkout, e.g. the one before resumed model calls), the episodes trained per minute (those in the groups the rollout
calls returned within ``--seconds``) and the share of the generated tokens never trained: after the window the
updates stop, the rollout call under way and the worker's episodes in flight end, and every token the stand-in
generated either is in a group the filter keeps or is wasted. Then, for this checkout, the CPU a resumed model call
costs: the same episodes played by slime's ``generate_and_rm_group`` with and without weight updates, the difference
in CPU of the two threads that serve them (slime's rollout loop, with chat_core and slime_helper's glue, and the
adapter's) divided by the resumed calls, min and median over ``--runs``.

Run: ``./bazelw run //tests/slime/bench:weight_updates [-- --compare /path/to/other/checkout]``; ``-- --smoke``
runs each cell for a few seconds once."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import chat_core
import slime_helper
import stand_in

PACKAGES = ("chat_core", "slime_helper")
OWN_PACKAGES = tuple(str(Path(module.__file__).parent.parent) for module in (chat_core, slime_helper))
"""The folders this checkout's chat_core and slime_helper are imported from, which ``--compare`` swaps."""
LENGTHS = (0.3, 1.0, 3.0)
"""Episode lengths, in intervals between weight updates: the time an episode's replies take to generate."""
TRANSFER_S = 0.3
_TICKS = os.sysconf("SC_CLK_TCK")


def script() -> list[Any]:
    """The replies that play the frames env's task: per turn, its three tool calls one reply each, then its answer."""
    from test_support import text, tool_call

    steps: list[Any] = []
    for calls, reply in zip(stand_in.TOOL_CALLS, stand_in.REPLIES, strict=True):
        steps += [*(tool_call(name, arguments) for name, arguments in calls), text(reply)]
    return steps


def thread_cpu_s(thread: threading.Thread) -> float:
    """The CPU seconds ``thread`` has used, from the kernel's account of it."""
    fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def named_thread(name: str) -> threading.Thread:
    return next(thread for thread in threading.enumerate() if thread.name == name)


class Updating:
    """A weight update every ``interval_s`` in a thread of its own, until ``stop``."""

    def __init__(self, updates: Any, interval_s: float):
        self._updates = updates
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-updates", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._updates.update()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def worker(options: argparse.Namespace) -> None:
    """One measured process: the rollout at one episode length, or the CPU of resumed calls; one JSON line."""
    from launch import THINKING_OFF, parse_slime_args, slime_command
    from sglang_stand_in import StandInSGLang, WeightUpdates
    from slime.utils.processing_utils import load_tokenizer

    tokenizer = load_tokenizer(options.checkpoint, trust_remote_code=True)
    steps = script()
    with StandInSGLang(tokenizer, script_of=lambda _: steps) as sglang:
        # Replies without Qwen3's <|im_end|>, which slime's adapter would leave in a reply's text and the frames env
        # would refuse in the end_turn it doesn't hold.
        sglang.writes = lambda reply: _written(tokenizer, reply)
        tokens = sum(len(_written(tokenizer, step)) for step in steps)
        sglang.seconds_per_token = options.length * options.interval / tokens
        args = parse_slime_args(
            slime_command(
                Path(options.checkpoint),
                (sglang.host, sglang.port),
                Path(options.rows),
                {},
                *THINKING_OFF,
                "--sglang-tool-call-parser", "qwen25",
                "--rollout-function-path", "slime_helper.generate_rollout_fully_async",
                "--sglang-server-concurrency", "4",
                "--rollout-batch-size", "2",
                "--global-batch-size", "4",
                "--num-rollout", "1000",
            )
        )  # fmt: skip
        updates = WeightUpdates(sglang.url, transfer_s=TRANSFER_S)
        if options.cpu:
            result = resumed_call_cpu(args, sglang, updates, options)
        else:
            result = rollout_window(args, sglang, updates, options)
    print("RESULT " + json.dumps(result), flush=True)


def _written(tokenizer: Any, reply: Any) -> list[int]:
    """``reply`` in Qwen3's writing, without the end of turn."""
    from test_support.qwen3 import qwen3_text

    return tokenizer.encode(qwen3_text(reply), add_special_tokens=False)


def rollout_window(args: Any, sglang: Any, updates: Any, options: argparse.Namespace) -> dict[str, float]:
    """Rollout calls for ``options.seconds`` with a weight update every ``options.interval`` s, then the drain."""
    from slime.rollout import fully_async_rollout
    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.rollout.filter_hub.base_types import call_dynamic_filter
    from slime.utils.misc import load_function
    from slime_helper import generate_rollout_fully_async

    data_source = RolloutDataSourceWithBuffer(args)
    keep = load_function(args.dynamic_sampling_filter_path)
    returned: list[tuple[float, list]] = []
    window = threading.Event()

    def calls() -> None:
        rollout_id = 0
        while not window.is_set():
            groups = generate_rollout_fully_async(args, rollout_id, data_source).samples
            returned.append((time.monotonic(), groups))
            rollout_id += 1

    began = time.monotonic()
    updating = Updating(updates, options.interval)
    caller = threading.Thread(target=calls, name="rollout-calls", daemon=True)
    caller.start()
    time.sleep(options.seconds)
    window.set()
    updating.stop()
    caller.join(timeout=300)
    worker = fully_async_rollout._global_worker
    worker.running = False
    worker.worker_thread.join(timeout=120)
    drained = [group for _, group in worker.get_completed_groups()]
    in_window = [groups for at, groups in returned if at <= began + options.seconds]
    kept = [group for _, groups in returned for group in groups] + [
        group for group in drained if call_dynamic_filter(keep, args, group).keep
    ]
    trained = sum(sum(sample.loss_mask) for group in kept for sample in group)
    generated = sum(len(reply.output) for reply in sglang.generated)
    return {
        "episodes_per_min": sum(len(group) for groups in in_window for group in groups) / options.seconds * 60,
        "wasted_share": 1 - trained / generated if generated else 0.0,
        "generated": generated,
        "cut_replies": sum(reply.finish == "abort" for reply in sglang.generated),
        "updates": updates.versions,
    }


def resumed_call_cpu(args: Any, sglang: Any, updates: Any, options: argparse.Namespace) -> dict[str, float]:
    """The CPU of slime's rollout loop and the adapter's threads per resumed model call: the same episodes played
    with and without weight updates."""
    from chat_core import EpisodeOutcome
    from slime.rollout.data_source import RolloutDataSource
    from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
    from slime.utils.async_utils import get_async_loop, run

    sampling = GenerateState(args).sampling_params.copy()
    groups = RolloutDataSource(args).get_samples(options.episodes // args.n_samples_per_prompt)

    async def played(batch: list) -> list:
        return await asyncio.gather(*(generate_and_rm_group(args, group, sampling) for group in batch))

    def measured(batch: list, updating: bool) -> tuple[float, int]:
        threads = [get_async_loop()._thread, named_thread("slime-helper-adapter")]
        before = sum(map(thread_cpu_s, threads))
        pausing = Updating(updates, options.interval) if updating else None
        outcomes = [EpisodeOutcome.from_metadata(sample.metadata) for group in run(played(batch)) for sample in group]
        if pausing is not None:
            pausing.stop()
        if not all(outcome.scored for outcome in outcomes):
            raise RuntimeError(f"an episode wasn't scored: {[o.flags for o in outcomes if not o.scored]}")
        return sum(map(thread_cpu_s, threads)) - before, sum(outcome.resumed_calls for outcome in outcomes)

    run(played(copy.deepcopy(groups[:1])))
    quiet, _ = measured(copy.deepcopy(groups), updating=False)
    paused, resumed = measured(copy.deepcopy(groups), updating=True)
    calls = options.episodes * len(script())
    return {
        "resumed": resumed,
        "calls": calls,
        "ms_per_call": quiet / calls * 1000,
        "ms_per_resumed_call": (paused - quiet) / resumed * 1000 if resumed else float("nan"),
    }


def measure(packages: list[str], common: list[str]) -> dict[str, float]:
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
        raise SystemExit(f"a worker failed (exit status {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", type=Path, help="another checkout whose packages to measure side by side")
    parser.add_argument("--interval", type=float, default=4.0, help="seconds between weight updates")
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window of each rollout")
    parser.add_argument("--episodes", type=int, default=16, help="episodes of each CPU run")
    parser.add_argument("--runs", type=int, default=3, help="runs of the CPU measurement")
    parser.add_argument("--smoke", action="store_true", help="each cell for a few seconds, once")
    options = parser.parse_args()
    if options.smoke:
        options.interval, options.seconds, options.episodes, options.runs = 1.0, 6.0, 4, 1
    from test_support.checkpoint import QWEN3_0_6B, weightless_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        checkpoint = weightless_checkpoint(folder / "Qwen3-0.6B", QWEN3_0_6B)
        with stand_in.served("env", str(stand_in.FRAMES), "--tasks", "256") as env_url:
            import episode_overhead_bench

            rows_file = folder / "all.jsonl"
            metadata, _ = episode_overhead_bench.rows_of(env_url)
            rows_file.write_text("".join(json.dumps({"messages": [], "metadata": each}) + "\n" for each in metadata))
            common = [
                "--checkpoint", str(checkpoint), "--rows", str(rows_file), "--interval", str(options.interval),
                "--seconds", str(options.seconds), "--episodes", str(options.episodes),
            ]  # fmt: skip
            packages = {"this checkout": list(OWN_PACKAGES)}
            if options.compare is not None:
                packages[f"{options.compare}"] = [str(options.compare / "packages" / name) for name in PACKAGES]
            windows = {
                (name, length): measure(folders, [*common, "--length", str(length)])
                for length in LENGTHS
                for name, folders in packages.items()
            }
            cpu = [measure(list(OWN_PACKAGES), [*common, "--length", "1", "--cpu"]) for _ in range(options.runs)]
    report(options, windows, cpu)


def report(options: argparse.Namespace, windows: dict[tuple[str, float], dict[str, float]], cpu: list) -> None:
    print(
        f"\nA weight update every {options.interval:g} s (pause in abort mode, flush, {TRANSFER_S:g} s transfer, "
        f"continue); {options.seconds:g} s of rollout calls each"
    )
    rows = [["packages", "episode / interval", "episodes trained / min", "generated tokens never trained", "cut"]]
    for (name, length), measured in windows.items():
        rows.append(
            [
                name,
                f"{length:g}",
                f"{measured['episodes_per_min']:.1f}",
                f"{measured['wasted_share']:.0%} of {measured['generated']:,}",
                f"{measured['cut_replies']} replies, {measured['updates']} updates",
            ]
        )
    _table(rows)
    print("\nCPU ms of the rollout loop and adapter threads, min / median of the runs")
    per_call = sorted(run["ms_per_call"] for run in cpu)
    per_resumed = sorted(run["ms_per_resumed_call"] for run in cpu)
    _table(
        [
            ["per model call", "per resumed model call (extra)", "resumed calls a run"],
            [
                f"{per_call[0]:.2f} / {statistics.median(per_call):.2f}",
                f"{per_resumed[0]:.2f} / {statistics.median(per_resumed):.2f}",
                ", ".join(str(run["resumed"]) for run in cpu),
            ],
        ]
    )


def _table(rows: list[list[str]]) -> None:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("| " + " | ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) + " |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        parser = argparse.ArgumentParser()
        parser.add_argument("worker")
        parser.add_argument("--checkpoint", required=True)
        parser.add_argument("--rows", required=True)
        parser.add_argument("--interval", type=float, required=True)
        parser.add_argument("--seconds", type=float, required=True)
        parser.add_argument("--episodes", type=int, required=True)
        parser.add_argument("--length", type=float, required=True)
        parser.add_argument("--cpu", action="store_true")
        worker(parser.parse_args())
    else:
        main()
