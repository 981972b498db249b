"""Functions the Miles tier names in Miles' launch flags, so Miles loads them by their import path as it would a
user's: agents with a short model deadline and with short tool answers (beside the abort hook Miles looks for next to
them) and a ``--rollout-all-samples-process-path`` that keeps the groups the dynamic filter dropped, for a test to
read."""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from chat_core import Limits
from miles_helper.agent import abort, make_agent

MODEL_DEADLINE_S = 5.0
TOOL_ANSWER_CHARS = 12

run_with_deadline = make_agent(Limits(model_deadline_s=MODEL_DEADLINE_S))
run_with_short_tool_answers = make_agent(Limits(max_tool_answer_chars=TOOL_ANSWER_CHARS))

recorded_groups: list[list[Any]] = []


def record_all_samples(args: Namespace, all_samples: list[list[Any]], data_source: Any) -> None:
    """Keep every group the rollout finished, those the filter dropped included."""
    recorded_groups.extend(all_samples)


__all__ = ["abort", "record_all_samples", "recorded_groups", "run_with_deadline", "run_with_short_tool_answers"]
