"""The record of each episode ``evaluate`` plays, one JSON line of ``DIR/episodes.jsonl`` appended as the episode
ends: the split, the row (its task's index in the split), the task's name, the sample number, the model, the
episode's outcome under ``OUTCOME_KEY`` (``EpisodeOutcome.from_metadata`` reads a record back) and the transcript.
A killed run keeps every episode it finished."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from chat_core._wire import parse_json
from chat_core.episode_ref import EpisodeRef
from chat_core.evaluate.errors import EvaluateError
from chat_core.record.outcome import OUTCOME_KEY, EpisodeOutcome

EPISODES = "episodes.jsonl"
_RECORD_ENCODER = json.JSONEncoder(ensure_ascii=False)


def new_record(ref: EpisodeRef, sample: int, model: str, outcome: EpisodeOutcome) -> dict[str, Any]:
    """The record of sample ``sample`` of ``ref``'s row, played by ``model``, without its transcript."""
    return {
        "split": ref.split,
        "row": ref.index,
        "task": ref.task_name,
        "sample": sample,
        "model": model,
        OUTCOME_KEY: outcome.to_metadata(),
    }


def append_record(file: IO[str], record: Mapping[str, Any], transcript: list[dict[str, Any]]) -> None:
    """Write ``record`` with its episode's ``transcript`` to ``file`` as one whole line, flushed at once so a
    killed run keeps it."""
    file.write(_RECORD_ENCODER.encode({**record, "transcript": transcript}) + "\n")
    file.flush()


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
