"""Playing a run's episodes: each (split, row, sample) still missing from ``DIR/episodes.jsonl``, after a pre-flight
request, ``concurrency`` at a time against any OpenAI-compatible chat endpoint (SGLang, vLLM, a hosted API, slime's
adapter, Miles' session server), each record appended as its episode ends; then the run's summary.

Pipeline: rows → pre-flight (``chat_core.evaluate.preflight``) → ``play`` each episode still missing →
``DIR/episodes.jsonl`` (``chat_core.evaluate.records``) → ``DIR/summary.json`` (``chat_core.evaluate.summary``). A
killed run keeps every episode it finished; resuming plays only the ones missing."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from chat_core.episode.chat import ChatEndpoint
from chat_core.episode.conversation import check_sampling
from chat_core.episode.loop import play
from chat_core.episode_ref import EpisodeRef
from chat_core.evaluate.errors import EvaluateError
from chat_core.evaluate.preflight import preflight
from chat_core.evaluate.records import EPISODES, append_record, new_record, read_records
from chat_core.evaluate.summary import SUMMARY, summarize
from chat_core.limits import Limits
from chat_core.record.outcome import EpisodeOutcome

DEFAULT_CONCURRENCY = 32


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
    check_sampling(run.sampling)
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
            record = new_record(episode.ref, episode.sample, run.chat.model, outcome)
            append_record(file, record, result.transcript)
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
