"""Rows played the way slime's rollout plays them: a group read by slime's own data source from the rows file,
handed to ``generate_and_rm_group`` on slime's own background event loop."""

from __future__ import annotations

import json
from argparse import Namespace
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from slime.rollout.data_source import RolloutDataSource
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import run


def group_of(args: Namespace, task: str) -> list:
    """The group of ``task``'s row, as slime's data source gives it: ``--n-samples-per-prompt`` copies of the sample
    slime's ``Dataset`` reads from the row in ``--prompt-data``."""
    position = _row_of(Path(args.prompt_data), task)
    only_that_row = Namespace(**{**vars(args), "prompt_data": f"{args.prompt_data}@[{position}:{position + 1}]"})
    [group] = RolloutDataSource(only_that_row).get_samples(1)
    return group


def rollout(args: Namespace, group: list, *, evaluation: bool = False) -> list:
    """``group`` played by slime's ``generate_and_rm_group`` with slime's sampling settings: one list of samples per
    episode."""
    return on_slime_loop(generate_and_rm_group(args, group, sampling_params(args), evaluation=evaluation))


def sampling_params(args: Namespace) -> dict[str, Any]:
    return GenerateState(args).sampling_params.copy()


def on_slime_loop(coroutine: Coroutine) -> Any:
    """Run ``coroutine`` on the event loop slime's rollout runs on, and return its result."""
    return run(coroutine)


def split_response(sample: Any) -> tuple[list[int], list[int]]:
    """The response tokens of ``sample`` that are trained (loss mask 1) and those that are masked (0)."""
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    assert len(response) == len(sample.loss_mask) == len(sample.rollout_log_probs)
    trained = [token for token, mask in zip(response, sample.loss_mask, strict=True) if mask]
    masked = [token for token, mask in zip(response, sample.loss_mask, strict=True) if not mask]
    return trained, masked


def _row_of(path: Path, task: str) -> int:
    names = [json.loads(line)["metadata"]["episode"]["task_name"] for line in path.read_text().splitlines()]
    return names.index(task)
