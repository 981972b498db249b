"""What long episodes cost and train in slime's rollout, this checkout against another (``--compare``): a benchmark,
not a test. Each side is a worker process importing chat_core and slime_helper from its checkout and playing
episodes through ``slime_helper.generate.generate`` exactly as slime's rollout calls it, with slime's real
``OpenAIAdapter`` (a launch parsed by slime's ``parse_args``, the family's real tokenizer and chat template, thinking
off where it has a switch), agent-env's real env server (the sample bundle's warehouse) and the slime tier's stand-in
for SGLang's ``/generate``, writing each reply as the family's template writes it.

1. Parallel tool calls: the synthetic episode of docs/PERFORMANCE.md (4 env turns, a system prompt of about 1,500
   tokens) with each turn's first reply making 3 tool calls, then an answer. Per episode: the tool calls the env
   ran, the tool calls the model wrote, the samples, their tokens and the tokens trained (loss mask 1), the reward,
   and the episode's wall time (min / median over ``--repeats``).
2. A full context: an episode of 16 env turns of one reply each, launched with ``--rollout-max-context-len`` at the
   length of the prompt that opens turn ``FILLS_AT``: the chat requests and the env calls (list_tools, tool calls,
   end_turn) made after the request that found the context full, read from the episode's spans on its sample's
   trace; the stand-in's ``/generate`` calls for prompts that no longer fit; the turns played; the reward; and where
   the sample ends.

Run: ``./bazelw run //tests/slime/bench:long_episode -- --compare OTHER_CHECKOUT [--family NAME] [--repeats N]``;
``--smoke`` plays one episode of each, for the first family only."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from argparse import Namespace
from pathlib import Path
from typing import Any

import chat_core
import slime_helper

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("chat_core", "slime_helper")
OWN_PACKAGES = tuple(str(Path(module.__file__).parent.parent) for module in (chat_core, slime_helper))
"""The folders this checkout's chat_core and slime_helper are imported from, which ``--compare`` swaps."""
REPEATS = 5
ENV_TURNS = 4
CALLS = 3
LONG_TURNS = 16
FILLS_AT = 8
SYSTEM_RULE = "Every crate has a shelf, every shelf a number and a letter, and every answer names the shelf it read. "
SYSTEM_PROMPT = "You keep a warehouse. " + SYSTEM_RULE * 68
"""About 1,500 tokens in every family's tokenizer."""
FRUIT = ("pears", "apples", "plums", "figs", "limes", "kiwis", "dates", "grapes", "lemons", "melons", "cherries")


def _crates(turn: int) -> list[str]:
    return [f"{FRUIT[(turn * CALLS + at) % len(FRUIT)]}-{turn}" for at in range(CALLS)]


def _prompt(**fields: Any) -> dict[str, Any]:
    return {"type": "prompt_agent", "agent_name": "agent", "poll_interval_seconds": 0.2, **fields}


def tasks() -> dict[str, list[dict[str, Any]]]:
    """The two tasks the benchmark plays: ``parallel`` (the synthetic episode) and ``long_talk`` (16 turns)."""
    parallel = [
        {"id": "warehouse", "type": "deploy_env", "env_id": "warehouse"},
        {"id": "agent", "type": "deploy_agent", "agent_name": "agent", "env_ids": ["warehouse"],
         "system_prompt": SYSTEM_PROMPT},
        *(_prompt(id=f"find{turn}", prompt_id=f"find{turn}", prompt=f"Add the crates {', '.join(_crates(turn))}.")
          for turn in range(ENV_TURNS)),
        {"id": "answered", "type": "agent_prompt_response_verifier", "prompt_id": f"find{ENV_TURNS - 1}",
         "verifier_id": "answered",
         "criteria": [{"type": "response_contains", "criterion": "says so", "needles": ["shelves"]}]},
    ]  # fmt: skip
    long_talk = [
        {"id": "agent", "type": "deploy_agent", "agent_name": "agent", "system_prompt": "You chat with the workers."},
        *(_prompt(id=f"turn{turn}", prompt_id=f"turn{turn}", prompt=f"Turn {turn}: how is crate {turn}?")
          for turn in range(LONG_TURNS)),
        {"id": "fine", "type": "agent_prompt_response_verifier", "prompt_id": f"turn{LONG_TURNS - 1}",
         "verifier_id": "fine",
         "criteria": [{"type": "response_contains", "criterion": "says fine", "needles": ["fine"]}]},
    ]  # fmt: skip
    return {"parallel": parallel, "long_talk": long_talk}


def scripts() -> dict[str, list[Any]]:
    """The model's replies to each task, by the marker its first prompt holds."""
    from test_support import text, tool_call, tool_calls

    parallel: list[Any] = []
    for turn in range(ENV_TURNS):
        parallel.append(tool_calls(*(tool_call("add_crate", {"name": crate}) for crate in _crates(turn))))
        parallel.append(text(f"The crates {', '.join(_crates(turn))} are on their shelves."))
    return {
        "Add the crates": parallel,
        "how is crate": [text(f"Crate {turn} is fine.") for turn in range(LONG_TURNS)],
    }


def worker(options: Namespace) -> None:
    """Play ``options.repeats`` episodes of each task for one family with this process's packages, and print one
    JSON line of figures."""
    from launch import parse_slime_args, slime_command
    from sglang_stand_in import StandInSGLang
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.async_utils import run
    from slime.utils.processing_utils import load_tokenizer
    from slime.utils.types import Sample
    from slime_helper import AdapterService
    from slime_helper.generate import generate
    from test_support.families import FAMILIES, written

    family = next(family for family in FAMILIES if family.name == options.family)
    mode = family.modes[0]
    tokenizer = load_tokenizer(options.checkpoint, trust_remote_code=True)
    rows = {
        json.loads(line)["metadata"]["episode"]["task_name"]: json.loads(line)
        for line in Path(options.rows).read_text().splitlines()
    }
    by_marker = scripts()

    def script_of(prompt: str) -> list[Any]:
        [steps] = [steps for marker, steps in by_marker.items() if marker in prompt]
        return steps

    with StandInSGLang(tokenizer, script_of) as sglang:
        sglang.writes = lambda reply: tokenizer.encode(
            written(tokenizer, family, mode, reply, "I should look this up."), add_special_tokens=False
        )
        flags = ["--sglang-tool-call-parser", family.tool_parser]
        if mode.template_kwargs:
            flags += ["--apply-chat-template-kwargs", json.dumps(dict(mode.template_kwargs))]
        command = slime_command(Path(options.checkpoint), (sglang.host, sglang.port), Path(options.rows), {}, *flags)
        args = parse_slime_args(command)
        sampling = GenerateState(args).sampling_params.copy()

        def episode(task: str, launch: Namespace, index: int) -> tuple[Any, list[Any]]:
            row = rows[task]
            base = Sample(index=index, group_index=index, prompt=row["messages"], metadata=row["metadata"])
            samples = run(generate(launch, base, sampling))
            return base, samples

        parallel = []
        for index in range(options.repeats):
            sglang.clear()
            _, samples = episode("parallel", args, index)
            outcome = samples[0].metadata["episode_outcome"]
            parallel.append(
                {
                    "env_tool_calls": outcome["tool_calls"],
                    "written_tool_calls": sum(len(step.tool_calls) for step in by_marker["Add the crates"]),
                    "samples": len(samples),
                    "tokens": sum(len(sample.tokens) for sample in samples),
                    "trained": sum(sum(sample.loss_mask) for sample in samples),
                    "generated": sum(len(reply.output) for reply in sglang.generated),
                    "reward": outcome["reward"],
                    "wall_s": outcome["wall_s"],
                }
            )

        sglang.clear()
        episode("long_talk", args, 0)
        limit = len(sglang.generated[FILLS_AT - 1].prompt)
        AdapterService.reset()
        filling = Namespace(**{**vars(args), "rollout_max_context_len": limit})
        filled = []
        for index in range(options.repeats):
            sglang.clear()
            _, samples = episode("long_talk", filling, index)
            outcome = samples[0].metadata["episode_outcome"]
            after = _after_the_fill(samples[0].trace["events"])
            last = sglang.generated[-1]
            filled.append(
                {
                    **after,
                    "generate_calls_past_the_limit": sum(len(reply.prompt) >= limit for reply in sglang.generated),
                    "turns": outcome["turns"],
                    "reward": outcome["reward"],
                    "flags": sorted({flag["kind"] for flag in outcome["flags"]}),
                    "sample_ends_on_the_last_reply": samples[0].tokens == [*last.prompt, *last.output],
                    "wall_s": outcome["wall_s"],
                }
            )
        AdapterService.reset()
    print("RESULT " + json.dumps({"parallel": parallel, "filled": filled, "limit": limit}), flush=True)


def _after_the_fill(events: list[dict[str, Any]]) -> dict[str, int]:
    """The chat requests and env calls an episode's spans show after the chat request of turn ``FILLS_AT``, the one
    whose prompt no longer fit."""
    started = [event for event in events if event["type"] == "span_start" and event["name"].startswith("episode/")]
    fill = next(
        at
        for at, event in enumerate(started)
        if event["name"] == "episode/model_call" and event.get("attrs", {}).get("turn") == FILLS_AT
    )
    later = [event["name"].removeprefix("episode/") for event in started[fill + 1 :]]
    return {
        "model_calls_after": later.count("model_call"),
        "env_calls_after": sum(later.count(name) for name in ("list_tools", "tool_call", "end_turn")),
    }


def measure(packages: list[str], options: list[str]) -> dict[str, Any]:
    """One worker's figures, with chat_core and slime_helper from the folders ``packages``."""
    rest = [entry for entry in sys.path if entry and entry not in OWN_PACKAGES]
    done = subprocess.run(
        [sys.executable, __file__, "worker", *options],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(packages + rest)},
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"a worker failed (exit status {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", type=Path, help="another checkout whose packages to measure side by side")
    parser.add_argument("--family", action="append", help="only this family (repeat it); all by default")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--smoke", action="store_true", help="one episode of each, for the first family only")
    options = parser.parse_args()
    from chat_core.prepare import write_rows
    from test_support import SAMPLE_BUNDLE, serve_bundle
    from test_support.checkpoint import family_checkpoint
    from test_support.families import FAMILIES

    families = [family for family in FAMILIES if not options.family or family.name in options.family]
    repeats = 1 if options.smoke else options.repeats
    if options.smoke:
        families = families[:1]
    sides = {"this checkout": list(OWN_PACKAGES)}
    if options.compare is not None:
        sides[str(options.compare)] = [str(options.compare / "packages" / name) for name in PACKAGES]
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    with tempfile.TemporaryDirectory(prefix="long-episode-bench-") as scratch:
        folder = Path(scratch)
        bundle = folder / "bundle"
        (bundle / "tasks").mkdir(parents=True)
        for part in ("envs", "artifacts"):
            shutil.copytree(SAMPLE_BUNDLE / part, bundle / part)
        for name, steps in tasks().items():
            (bundle / "tasks" / f"{name}.json").write_text(json.dumps(steps))
        with serve_bundle(
            bundle, python=os.environ.get("ENV_SERVER_PYTHON") or REPO / ".venv" / "bin" / "python"
        ) as served:
            asyncio.run(write_rows(served.url, folder / "rows", progress=False))
            for family in families:
                checkpoint = family_checkpoint(folder / family.name, family)
                common = [
                    "--family", family.name, "--checkpoint", str(checkpoint),
                    "--rows", str(folder / "rows" / "all.jsonl"), "--repeats", str(repeats),
                ]  # fmt: skip
                results = {side: measure(packages, common) for side, packages in sides.items()}
                report(family.name, results)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


def report(family: str, results: dict[str, dict[str, Any]]) -> None:
    print(f"\n## {family}")
    print("1. the synthetic episode, 3 tool calls a reply: per episode (wall time min / median)")
    for side, figures in results.items():
        runs = figures["parallel"]
        first = runs[0]
        walls = sorted(run["wall_s"] for run in runs)
        print(
            f"  {side}: env ran {first['env_tool_calls']} of {first['written_tool_calls']} calls; "
            f"{first['samples']} sample(s), {first['tokens']:,} tokens, {first['trained']:,} trained of "
            f"{first['generated']:,} generated; reward {first['reward']}; wall {walls[0]:.2f} / "
            f"{statistics.median(walls):.2f} s"
        )
    print(
        f"2. 16 env turns, the context full at turn {FILLS_AT} (limit {next(iter(results.values()))['limit']} tokens)"
    )
    for side, figures in results.items():
        runs = figures["filled"]
        first = runs[0]
        walls = sorted(run["wall_s"] for run in runs)
        print(
            f"  {side}: after the fill {first['model_calls_after']} chat requests, {first['env_calls_after']} env "
            f"calls, {first['generate_calls_past_the_limit']} /generate calls past the limit; {first['turns']} turns "
            f"played, reward {first['reward']}, flags {first['flags']}; sample ends on the last reply: "
            f"{first['sample_ends_on_the_last_reply']}; wall {walls[0]:.2f} / {statistics.median(walls):.2f} s"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker_parser = argparse.ArgumentParser()
        worker_parser.add_argument("worker")
        worker_parser.add_argument("--family", required=True)
        worker_parser.add_argument("--checkpoint", required=True)
        worker_parser.add_argument("--rows", required=True)
        worker_parser.add_argument("--repeats", type=int, required=True)
        worker(worker_parser.parse_args())
    else:
        main()
