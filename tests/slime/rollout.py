"""Rows played the way slime's rollout plays them: a group read by slime's own data source from the rows file,
handed to ``generate_and_rm_group`` on slime's own background event loop; a whole step's batch, kept or dropped by
the launch's dynamic filter and flattened as slime's rollout manager does; and slime's own rollout manager to turn
the batch into train data."""

from __future__ import annotations

import asyncio
import itertools
import json
from argparse import Namespace
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from slime.observability.rollout_data_utils import validate_rollout_id_annotated
from slime.ray.rollout import RolloutManager
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.filter_hub.base_types import call_dynamic_filter
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.misc import load_function
from test_support import REWARDS, SCRIPTS, text
from test_support.script import Step

SAMPLE_PER_TURN = "episode_append_only_chat: false\n"
"""The ``--custom-config-path`` YAML that turns the append-only rendering off: with thinking off, Qwen3's own
template then makes each model call of an episode a sample of its own."""


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


MISSES = {
    "two_turns": (text("Welcome to the warehouse!"), text("See you tomorrow.")),
    "played": (text("I don't know where the pears are."),),
}
"""For each task whose group should hold different rewards, a script its second episode plays, scoring 0: two
turns, or one reply without the tool call, so one sample where the first episode, calling a tool, gives two."""
TASKS = ("two_turns", "played", "reply_only", "scores_zero", "fails_after_the_turn")
"""The groups played: two-sample episodes scoring 1 and 0, a two-sample episode scoring 1 beside a one-sample one
scoring 0, two groups whose episodes all score the same, and one the filter drops."""


def first_hits_then_misses(served):
    """A ``script_of`` giving each task's first session its test_support script and the next one its MISSES
    script, where it has one."""
    return by_session(served, lambda task, n: MISSES[task] if n == 2 and task in MISSES else SCRIPTS[task])


def by_session(served, script: Callable[[str, int], Sequence[Step]]) -> Callable[[str], Sequence[Step]]:
    """A ``script_of`` giving the n-th session of each task, counted from 1, ``script(task, n)``."""
    prompts = {task["prompt"]: task["name"] for task in served.tasks()}
    sessions: Counter[str] = Counter()

    def script_of(prompt: str) -> Sequence[Step]:
        [name] = [name for text_, name in prompts.items() if text_ in prompt]
        sessions[name] += 1
        return script(name, sessions[name])

    return script_of


def played_batch(args, tasks=TASKS) -> list:
    """The flat batch slime trains on after one rollout of ``tasks``' groups: the groups the launch's filter keeps,
    checked and flattened as ``RolloutManager._get_rollout_data`` does."""
    groups = RolloutDataSource(args).get_samples(len(REWARDS))
    chosen = [group for group in groups if group[0].metadata["episode"]["task_name"] in tasks]
    assert len(chosen) == len(tasks)

    async def all_groups():
        return await asyncio.gather(*(generate_and_rm_group(args, group, sampling_params(args)) for group in chosen))

    played = on_slime_loop(all_groups())
    dynamic_filter = load_function(args.dynamic_sampling_filter_path)
    return flattened([group for group in played if call_dynamic_filter(dynamic_filter, args, group).keep])


def flattened(groups: list) -> list:
    """A rollout's groups as the flat batch slime trains on, checked and flattened as
    ``RolloutManager._get_rollout_data`` does."""
    validate_rollout_id_annotated(groups)
    while isinstance(groups[0], list):
        groups = list(itertools.chain.from_iterable(groups))
    return groups


def rollout_manager(args: Namespace, *, post_process: bool = True) -> Any:
    """slime's ``RolloutManager`` for ``args`` without its engines, post-processing rewards with the launch's
    ``--custom-reward-post-process-path`` (slime's own normalisation when ``post_process`` is False).

    ``RolloutManager`` is a Ray actor; its methods are reached on the class behind the actor
    (``__ray_metadata__.modified_class``) with ``__init__`` skipped, since that starts SGLang engines, and only the
    attributes ``_post_process_rewards`` and ``_convert_samples_to_train_data`` read are set, as ``__init__`` sets
    them."""
    manager = object.__new__(RolloutManager.__ray_metadata__.modified_class)
    manager.args = args
    manager.custom_convert_samples_to_train_data_func = None
    manager.custom_reward_post_process_func = (
        load_function(args.custom_reward_post_process_path) if post_process else None
    )
    return manager


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
