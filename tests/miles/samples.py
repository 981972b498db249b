"""What the Miles tier reads of a rollout's samples: a group's episodes, the samples of the group a rollout kept or
of the groups its filter dropped, and a sample's response split into its trained and masked stretches."""

from __future__ import annotations

from typing import Any

import miles_hooks
from miles.utils.types import Sample


def episodes_of(group: list[Any]) -> list[list[Sample]]:
    """A group's episodes, each as its samples: one under v1, one per leaf under v2."""
    return [member if isinstance(member, list) else [member] for member in group]


def trained_and_masked(miles: Any, sample: Sample) -> tuple[list[str], list[str]]:
    """The response's trained and masked stretches, decoded, in order."""
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    assert len(sample.loss_mask) == len(response) == len(sample.rollout_log_probs)
    spans: dict[int, list[str]] = {0: [], 1: []}
    start = 0
    for end in range(1, len(response) + 1):
        if end == len(response) or sample.loss_mask[end] != sample.loss_mask[start]:
            spans[sample.loss_mask[start]].append(miles.decode(response[start:end]))
            start = end
    return spans[1], spans[0]


def kept_samples(miles: Any, output: Any, task: str) -> list[Sample]:
    """The samples of the one group ``output`` kept, which must be ``task``'s."""
    (group,) = output.samples
    episodes = episodes_of(group)
    assert {miles.task_of(sample) for samples in episodes for sample in samples} == {task}
    return [sample for samples in episodes for sample in samples]


def dropped_samples(task: str) -> list[Sample]:
    """The samples of ``task`` in the groups the rollout finished, the dropped ones included."""
    return [
        sample
        for group in miles_hooks.recorded_groups
        for samples in episodes_of(group)
        for sample in samples
        if sample.metadata["episode"]["task_name"] == task
    ]
