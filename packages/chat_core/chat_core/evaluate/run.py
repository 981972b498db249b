"""``python -m chat_core.evaluate ROWS --model-url URL --model NAME --out DIR`` plays the episodes of ``prepare``'s
rows against any OpenAI-compatible chat endpoint (SGLang, vLLM, a hosted API, slime's adapter, Miles' session
server) and reports how the model did: the step-0 number before training, and the same for a checkpoint after.

Pipeline: rows → pre-flight (one tiny chat completion: URL, model name, key) → ``play`` each (split, row, sample)
still missing, ``--concurrency`` at a time → ``DIR/episodes.jsonl``, one record per episode appended as it ends →
``DIR/summary.json`` and a printed table (→ the deltas to ``--compare``'s run).

A record is the split, the row (its task's index in the split), the task's name, the sample number, the model, the
episode's outcome under ``OUTCOME_KEY`` (``EpisodeOutcome.from_metadata`` reads a record back) and the transcript.
A killed run keeps every episode it finished; ``--resume`` plays only the ones missing."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from chat_core._cli import positive_int
from chat_core._wire import encoded, parse_json, wire_text
from chat_core.episode.chat import ChatEndpoint, post
from chat_core.episode.loop import RESERVED_BODY_KEYS, play
from chat_core.limits import Limits
from chat_core.net.http_request import HttpError
from chat_core.prepare.rows import EpisodeRef
from chat_core.record.metrics import episode_metrics
from chat_core.record.outcome import OUTCOME_KEY, EpisodeOutcome

DEFAULT_CONCURRENCY = 32
EPISODES = "episodes.jsonl"
SUMMARY = "summary.json"
PASS_REWARD = 1.0
"""An episode passes, for pass@k, when it is scored and earns at least this: the env's full reward."""
_PREFLIGHT_S = 60.0
_RECORD_ENCODER = json.JSONEncoder(ensure_ascii=False)


class EvaluateError(Exception):
    """The run can't start or go on: the rows, the output folder or the model endpoint is wrong; the message says
    which and what to do."""


@dataclass(frozen=True)
class Episode:
    """One episode to play: sample ``sample`` of the row ``metadata`` (task ``ref.index`` of ``ref.split``)."""

    ref: EpisodeRef
    metadata: Mapping[str, Any]
    sample: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.ref.split, self.ref.index, self.sample)


@dataclass(frozen=True)
class Run:
    """What ``evaluate`` plays and with what: the chat endpoint, the request body's extra keys, the bounds."""

    chat: ChatEndpoint
    sampling: Mapping[str, Any]
    limits: Limits
    concurrency: int = DEFAULT_CONCURRENCY


def read_rows(path: Path, splits: Sequence[str] = ()) -> list[tuple[EpisodeRef, dict[str, Any]]]:
    """The rows at ``path`` (a ``prepare`` folder, whose every split is read unless ``splits`` names some, or one
    of its ``.jsonl`` files) as each row's episode and metadata. Raises EvaluateError when there is no such folder,
    file or split, or a line isn't a row ``prepare`` wrote."""
    if path.is_dir():
        found = {file.stem: file for file in sorted(path.glob("*.jsonl"))}
        if missing := [split for split in splits if split not in found]:
            raise EvaluateError(
                f"{path} has no split {', '.join(map(repr, missing))}; it has {', '.join(found) or 'none'}"
            )
        files = [found[split] for split in splits] if splits else list(found.values())
    elif path.is_file():
        if splits and list(splits) != [path.stem]:
            raise EvaluateError(f"{path} holds the split {path.stem!r} only; leave out --split or give the folder")
        files = [path]
    else:
        raise EvaluateError(f"{path} is neither a folder of rows nor a rows file; write them with chat_core.prepare")
    rows = []
    for file in files:
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            try:
                metadata = parse_json(line)["metadata"]
                rows.append((EpisodeRef.from_metadata(metadata), metadata))
            except (ValueError, KeyError, TypeError) as e:
                raise EvaluateError(f"{file}:{number} isn't a row written by chat_core.prepare ({e})") from None
    if not rows:
        raise EvaluateError(f"{path} holds no rows")
    return rows


def read_records(out: Path) -> list[dict[str, Any]]:
    """The records in ``out/episodes.jsonl`` without their transcripts, which the summary doesn't read and which
    would hold a whole earlier run in memory; none when there is no such file. A last line cut short by a killed
    run is cut off the file, so the episode is played again; any other line that isn't a record raises
    EvaluateError."""
    file = out / EPISODES
    if not file.exists():
        return []
    data = file.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        with open(file, "r+b") as handle:
            handle.truncate(len(data))
    records = []
    for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
        try:
            record = parse_json(line)
            if EpisodeOutcome.from_metadata(record) is None:
                raise KeyError(OUTCOME_KEY)
            record.pop("transcript", None)
            record["_key"] = (record["split"], record["row"], record["sample"])
            records.append(record)
        except (ValueError, KeyError, TypeError) as e:
            raise EvaluateError(f"{file}:{number} isn't an episode record ({e}); move the file aside") from None
    return records


async def preflight(chat: ChatEndpoint, sampling: Mapping[str, Any]) -> None:
    """Send one tiny chat completion to ``chat``, so a wrong URL, model name or key stops the run before any
    episode: the run's own body with one short message, its token limit (``max_completion_tokens`` where the
    sampling names it, as newer hosted models take it, else ``max_tokens``) set to 1. Transient failures are retried
    as the episode loop retries them (``chat_core.episode.chat.post``) for up to a minute. Raises EvaluateError with the
    server's message, on one line, when the endpoint can't be reached or answers with an error."""
    limit = "max_completion_tokens" if "max_completion_tokens" in sampling else "max_tokens"
    body = {**sampling, "model": chat.model, "messages": [{"role": "user", "content": "Say OK."}], limit: 1}
    try:
        headers = chat.request_headers()
    except ValueError as e:
        raise EvaluateError(str(e)) from None
    try:
        async with asyncio.timeout(_PREFLIGHT_S):
            answer = await post(
                chat,
                headers,
                encoded(body),
                deadline=time.monotonic() + _PREFLIGHT_S,
                max_answer_bytes=Limits.max_chat_answer_bytes,
            )
    except TimeoutError:
        raise EvaluateError(
            f"the model endpoint {chat.url} didn't answer the pre-flight request within {_PREFLIGHT_S:g} s"
        ) from None
    except HttpError as e:
        raise EvaluateError(f"the model endpoint {chat.url} can't be reached: {e}") from None
    if answer.status >= 400:
        raise EvaluateError(
            f"the model endpoint {chat.url} answered the pre-flight request for model {chat.model!r} with "
            f"HTTP {answer.status}: {' '.join(wire_text(answer.body).split())[:500]}"
        )


async def evaluate(
    rows: Sequence[tuple[EpisodeRef, Mapping[str, Any]]],
    run: Run,
    out: Path,
    *,
    samples: int,
    resume: bool,
    progress: bool = True,
) -> dict[str, Any]:
    """Play ``samples`` episodes of each row of ``rows`` with ``run`` (only those ``out/episodes.jsonl`` lacks when
    ``resume``), appending each record as its episode ends, then write ``out/summary.json`` and return it.

    Raises EvaluateError, before any episode, when ``out`` holds files and ``resume`` is off, holds episodes of
    another model, or the endpoint fails the pre-flight request (sent only when an episode is missing); ValueError
    when ``samples`` or ``run.concurrency`` is below 1, or ``run.sampling`` sets a key every request sends itself."""
    if samples < 1 or run.concurrency < 1:
        raise ValueError(f"samples and concurrency must be at least 1, not {samples} and {run.concurrency}")
    if clash := sorted(RESERVED_BODY_KEYS & set(run.sampling)):
        raise ValueError(f"the sampling sets {', '.join(clash)}, which every request sends itself; leave them out")
    if not resume and out.exists() and any(out.iterdir()):
        raise EvaluateError(f"{out} already holds files; give an empty or new folder, or --resume to go on with it")
    done = read_records(out)
    if others := sorted({record["model"] for record in done} - {run.chat.model}):
        raise EvaluateError(f"{out} holds episodes of model {', '.join(others)}, not {run.chat.model!r}")
    seen = {record["_key"] for record in done}
    todo = [
        episode
        for ref, metadata in rows
        for sample in range(samples)
        if (episode := Episode(ref, metadata, sample)).key not in seen
    ]
    if todo:
        await preflight(run.chat, run.sampling)
    out.mkdir(parents=True, exist_ok=True)
    outcomes = [EpisodeOutcome.from_metadata(record) for record in done]
    with (
        open(out / EPISODES, "a", encoding="utf-8", newline="\n") as file,
        tqdm(total=len(todo), desc="episodes", unit="ep", file=sys.stderr, disable=not progress) as bar,
    ):
        done += await _play_all(todo, run, file, bar, [outcome for outcome in outcomes if outcome is not None])
    summary = summarize(done, samples)
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


async def _play_all(
    todo: list[Episode], run: Run, file: IO[str], bar: tqdm, outcomes: list[EpisodeOutcome]
) -> list[dict[str, Any]]:
    """The records of ``todo``'s episodes without their transcripts, each written to ``file`` whole and flushed as
    it ends, by ``run.concurrency`` workers; ``bar`` shows the mean reward and the unscored count of these episodes
    and the earlier ``outcomes``."""
    pending = iter(todo)
    records: list[dict[str, Any]] = []
    rewards = [outcome.reward for outcome in outcomes if outcome.reward is not None]
    total, scored, unscored = sum(rewards), len(rewards), len(outcomes) - len(rewards)

    async def work() -> None:
        nonlocal total, scored, unscored
        for episode in pending:
            result = await play(episode.metadata, run.chat, run.sampling, run.limits)
            outcome = EpisodeOutcome.of(result)
            record = {
                "split": episode.ref.split,
                "row": episode.ref.index,
                "task": episode.ref.task_name,
                "sample": episode.sample,
                "model": run.chat.model,
                OUTCOME_KEY: outcome.to_metadata(),
            }
            file.write(_RECORD_ENCODER.encode({**record, "transcript": result.transcript}) + "\n")
            file.flush()
            records.append(record)
            if outcome.reward is None:
                unscored += 1
            else:
                total, scored = total + outcome.reward, scored + 1
            reward = f"{total / scored:.3f}" if scored else "-"
            bar.set_postfix_str(f"reward={reward}, unscored={unscored}", refresh=False)
            bar.update()

    async with asyncio.TaskGroup() as group:
        for _ in range(min(run.concurrency, len(todo))):
            group.create_task(work())
    return records


def summarize(records: Sequence[Mapping[str, Any]], samples: int) -> dict[str, Any]:
    """Per split (in the order first seen): ``chat_core.record.metrics``' numbers, the episodes unscored by flag kind,
    ``turns_p50``, ``tool_calls_p50``, ``pass@k`` for each k up to ``samples`` (see ``pass_at_k``) and per task
    ``episodes``, ``reward_mean`` and ``reward_se`` over its scored episodes."""
    by_split: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for record in records:
        by_split[record["split"]].append(record)
    splits = {}
    for split, held in by_split.items():
        outcomes = [EpisodeOutcome.from_metadata(record) for record in held]
        metrics: dict[str, Any] = episode_metrics(outcomes, [1] * len(outcomes))
        metrics["unscored"] = dict(Counter(outcome.reason for outcome in outcomes if not outcome.scored))
        metrics["turns_p50"] = statistics.median(outcome.turns for outcome in outcomes)
        metrics["tool_calls_p50"] = statistics.median(outcome.tool_calls for outcome in outcomes)
        metrics["model_retries"] = sum(outcome.model_retries for outcome in outcomes)
        rows: dict[int, list[EpisodeOutcome]] = defaultdict(list)
        tasks: dict[str, list[EpisodeOutcome]] = defaultdict(list)
        for record, outcome in zip(held, outcomes, strict=True):
            rows[record["row"]].append(outcome)
            tasks[record["task"]].append(outcome)
        passes = [_passes(played) for played in rows.values()]
        for k in range(1, samples + 1):
            if (value := _pass_at(passes, k)) is not None:
                metrics[f"pass@{k}"] = value
        metrics["tasks"] = {task: _mean_se(played) for task, played in sorted(tasks.items())}
        splits[split] = metrics
    return {"samples": samples, "pass_reward": PASS_REWARD, "splits": splits}


def pass_at_k(rows: Any, k: int) -> float | None:
    """The unbiased pass@k estimate (Chen et al. 2021): over the rows with at least ``k`` scored episodes, the mean
    of 1 - C(n - c, k) / C(n, k) for a row's n scored episodes of which c pass; None when no row has k. Unscored
    episodes are left out, so a failed request never counts as a failed answer."""
    return _pass_at([_passes(outcomes) for outcomes in rows], k)


def _passes(outcomes: Sequence[EpisodeOutcome]) -> tuple[int, int]:
    """A row's scored episodes and how many of them pass: all ``pass_at_k`` reads of a row, counted once for
    every k rather than once per k."""
    scored = [outcome for outcome in outcomes if outcome.scored]
    return len(scored), sum(outcome.reward >= PASS_REWARD for outcome in scored)


def _pass_at(passes: Sequence[tuple[int, int]], k: int) -> float | None:
    estimates = [1 - math.comb(n - c, k) / math.comb(n, k) for n, c in passes if n >= k]
    return statistics.fmean(estimates) if estimates else None


def _mean_se(outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    rewards = [outcome.reward for outcome in outcomes if outcome.scored]
    numbers = {"episodes": float(len(outcomes))}
    if rewards:
        numbers["reward_mean"] = statistics.fmean(rewards)
        numbers["reward_se"] = statistics.stdev(rewards) / math.sqrt(len(rewards)) if len(rewards) > 1 else 0.0
    return numbers


def table(summary: Mapping[str, Any]) -> str:
    """The summary as a person reads it: a block per split, then its tasks' mean rewards."""
    lines = []
    for split, metrics in summary["splits"].items():
        reward = _reward(metrics)
        passes = "  ".join(f"{name} {value:.3f}" for name, value in metrics.items() if name.startswith("pass@"))
        unscored = ", ".join(f"{kind} {count}" for kind, count in sorted(metrics["unscored"].items())) or "none"
        lines += [
            f"split {split}: {metrics['episodes']:.0f} episodes, reward {reward}, {passes}",
            f"  zero reward {metrics.get('zero_reward_share', 0):.1%} of scored; unscored: {unscored}; "
            f"model retries {metrics['model_retries']}",
            f"  turns p50 {metrics['turns_p50']:g} p90 {metrics['turns_p90']:g}; tool calls p50 "
            f"{metrics['tool_calls_p50']:g} p90 {metrics['tool_calls_p90']:g}; env {metrics['env_s_mean']:.2f} s, "
            f"model {metrics['model_s_mean']:.2f} s per episode",
        ]
        lines += [
            f"  {task}: {_reward(numbers)} ({numbers['episodes']:.0f})" for task, numbers in metrics["tasks"].items()
        ]
    return "\n".join(lines)


def compare(summary: Mapping[str, Any], other: Mapping[str, Any]) -> str:
    """The change in mean reward from ``other``'s run to ``summary``'s, per split and per task both ran, with the
    standard error of the difference (the two runs' errors combined, as independent samples)."""
    lines = []
    for split, metrics in summary["splits"].items():
        before = other["splits"].get(split)
        if before is None:
            continue
        lines.append(f"split {split}: {_delta(metrics, before)}")
        for task, numbers in metrics["tasks"].items():
            if task in before["tasks"]:
                lines.append(f"  {task}: {_delta(numbers, before['tasks'][task])}")
    return "\n".join(lines) or "no split in common"


def _reward(numbers: Mapping[str, Any]) -> str:
    if "reward_mean" not in numbers:
        return "- (nothing scored)"
    return f"{numbers['reward_mean']:.3f} ± {numbers['reward_se']:.3f}"


def _delta(now: Mapping[str, Any], before: Mapping[str, Any]) -> str:
    if "reward_mean" not in now or "reward_mean" not in before:
        return "- (nothing scored in one of the runs)"
    delta = now["reward_mean"] - before["reward_mean"]
    return (
        f"{before['reward_mean']:.3f} → {now['reward_mean']:.3f}: {delta:+.3f} ± "
        f"{math.hypot(now['reward_se'], before['reward_se']):.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    """The command: plays the episodes, prints the table (and the comparison) on stdout and returns 0; or says why
    it can't on stderr, in one line, and returns 1."""
    args = _parser().parse_args(argv)
    here = Path(os.environ.get("BUILD_WORKING_DIRECTORY", "."))
    try:
        sampling = _object(args.sampling, "--sampling")
        if args.chat_template_kwargs is not None:
            sampling["chat_template_kwargs"] = _object(args.chat_template_kwargs, "--chat-template-kwargs")
        headers = {}
        if args.api_key_env:
            if not (key := os.environ.get(args.api_key_env)):
                raise EvaluateError(f"--api-key-env names {args.api_key_env}, which isn't set in the environment")
            headers["Authorization"] = f"Bearer {key}"
        run = Run(
            ChatEndpoint(args.model_url.rstrip("/") + "/chat/completions", args.model, headers),
            sampling,
            Limits(
                max_turns=args.max_turns,
                max_tool_calls_per_turn=args.max_tool_calls_per_turn,
                model_deadline_s=args.model_deadline,
            ),
            args.concurrency,
        )
        other = _summary_of(here / args.compare) if args.compare else None
        summary = asyncio.run(
            evaluate(
                read_rows(here / args.rows, args.split), run, here / args.out, samples=args.samples, resume=args.resume
            )
        )
    except (EvaluateError, OSError, ValueError) as e:
        print(f"evaluate: {e}", file=sys.stderr)
        return 1
    print(table(summary))
    if other is not None:
        print(f"\ncompared with {args.compare}:\n{compare(summary, other)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m chat_core.evaluate",
        description="Play the episodes of chat_core.prepare's rows against an OpenAI-compatible chat endpoint and "
        "report the model's reward per split and task.",
    )
    parser.add_argument("rows", type=Path, help="a folder written by chat_core.prepare, or one of its .jsonl files")
    parser.add_argument("--model-url", required=True, help="the endpoint's OpenAI base URL, e.g. http://host:30000/v1")
    parser.add_argument("--model", required=True, help="the model name the requests' body gives")
    parser.add_argument("--out", type=Path, required=True, help="the folder for episodes.jsonl and summary.json")
    parser.add_argument("--split", action="append", default=[], help="a split to play (repeatable; default: all)")
    parser.add_argument("--api-key-env", help="the environment variable holding the API key, sent as a bearer token")
    parser.add_argument("--samples", type=positive_int, default=1, help="episodes per row, for pass@k (default 1)")
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=DEFAULT_CONCURRENCY,
        help=f"episodes at once (default {DEFAULT_CONCURRENCY})",
    )
    parser.add_argument("--sampling", default="{}", help='JSON for the request body, e.g. {"temperature": 0.6}')
    parser.add_argument(
        "--chat-template-kwargs", help='JSON sent as chat_template_kwargs, e.g. {"enable_thinking": false}'
    )
    defaults = Limits()
    parser.add_argument("--max-turns", type=positive_int, default=defaults.max_turns)
    parser.add_argument("--max-tool-calls-per-turn", type=positive_int, default=defaults.max_tool_calls_per_turn)
    parser.add_argument("--model-deadline", type=float, default=defaults.model_deadline_s, help="seconds per episode")
    parser.add_argument("--resume", action="store_true", help="play only the episodes DIR/episodes.jsonl lacks")
    parser.add_argument("--compare", type=Path, help="an earlier run's folder, whose rewards to print the change from")
    return parser


def _object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = parse_json(text)
    except ValueError as e:
        raise EvaluateError(f"{flag} isn't JSON ({e}): {text}") from None
    if not isinstance(value, dict):
        raise EvaluateError(f"{flag} must be a JSON object, not {text}")
    return value


def _summary_of(run: Path) -> dict[str, Any]:
    try:
        return json.loads((run / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EvaluateError(f"--compare {run}: no summary of a finished run there ({e})") from None
