"""slime's fully-async rollout as the slime tier runs it: the launch's extra flags, slime's own data source watched for
the groups slime's worker hands back to it, and what tests read of the groups that come out. The ``fully_async``
fixture (``conftest.py``) launches it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from chat_core import EpisodeOutcome
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.utils.types import Sample

FULLY_ASYNC = (
    "--rollout-function-path", "slime_helper.generate_rollout_fully_async",
    "--sglang-server-concurrency", "2",
)  # fmt: skip
GRPO_FILTER = ("--dynamic-sampling-filter-path", "slime_helper.keep_scored_nonzero_std_groups")
WHOLE_REPLIES = {
    "played": '<tool_call>\n{"name": "find_crate", "arguments": {"name": "pears"}}\n</tool_call><|im_end|>'
    "The crate of pears is on shelf 9C.<|im_end|>",
    "two_turns": "Welcome to the warehouse!<|im_end|>Goodbye, and thank you!<|im_end|>",
}
"""What an episode of each task trains on when played with its test_support script: every reply, whole."""


class WatchedDataSource(RolloutDataSourceWithBuffer):
    """slime's own data source, keeping a copy of each group the worker hands back to it (``handed_back``)."""

    def __init__(self, args):
        super().__init__(args)
        self.handed_back: list[list[Sample]] = []

    def add_samples(self, samples: list[list[Sample]]) -> None:
        self.handed_back += copy.deepcopy(samples)
        super().add_samples(samples)


def task_of(sample: Sample) -> str:
    return sample.metadata["episode"]["task_name"]


def outcome_of(sample: Sample) -> EpisodeOutcome:
    outcome = EpisodeOutcome.from_metadata(sample.metadata)
    assert outcome is not None, f"no episode outcome in {sample.metadata}"
    return outcome


def rows_file(rows: Path, tasks: tuple[str, ...], path: Path) -> Path:
    """``path``, holding the rows of ``tasks`` from ``rows/all.jsonl`` in that order."""
    by_task = {json.loads(line)["metadata"]["episode"]["task_name"]: line for line in (rows / "all.jsonl").open()}
    path.write_text("".join(by_task[task] for task in tasks))
    return path
