"""slime's fully-async rollout with this helper's episodes:

    python3 train_async.py ... --rollout-function-path slime_helper.generate_rollout_fully_async

slime's fully-async worker (``slime.rollout.fully_async_rollout``) keeps episodes playing across rollout calls, so a
step doesn't wait for the slowest one. It calls ``generate_and_rm_group`` itself and never the dynamic-sampling
filter, takes one sample per episode (it sorts a rollout's groups by ``group[0].index`` and plays again, from the data
buffer, a group holding a sample whose status is ABORTED), raises in an evaluation, and only logs what a generate
function raises, so a refusal from inside an episode would leave the run waiting rather than stop it.

So this rollout function checks the launch before the worker starts, where a refusal stops the run; runs slime's own
worker; filters each group it hands back with the launch's ``--dynamic-sampling-filter-path`` as slime's standard
rollout does, drawing more groups from the worker until ``--rollout-batch-size`` groups are kept and counting each
drop as ``rollout/dynamic_filter/drop_<reason>``; and evaluates with slime's own eval rollout on the event loop the
worker plays on, since both take slime's ``GenerateState`` semaphore, which works on one loop only (waiting for it on
another raises). Within it ``slime_helper.generate`` returns one sample per episode, and an episode whose reply
SGLang aborted (as a weight update does) comes back ABORTED, so that the worker plays its group again.
"""

from __future__ import annotations

import asyncio
from argparse import Namespace
from typing import Any

from slime_helper._slime import slime
from slime_helper.adapter import APPEND_ONLY_SETTING, AdapterService
from slime_helper.errors import AppendOnlyChatNeeded, FullyAsyncEvaluation, UnfilteredFullyAsync

FULLY_ASYNC_ROLLOUT = "slime_helper.generate_rollout_fully_async"
"""The ``--rollout-function-path`` of a fully-async launch with this helper."""


class _WorkerLoop:
    """The event loop slime's fully-async worker last played a training episode of this process on."""

    current: asyncio.AbstractEventLoop | None = None


def generate_rollout_fully_async(args: Namespace, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's ``--rollout-function-path``: ``--rollout-batch-size`` groups from slime's fully-async worker that the
    launch's dynamic filter keeps, with the filter's drop counts as the rollout's metrics; with ``evaluation``,
    slime's eval rollout, played on the worker's event loop.

    Raises, before any episode plays, what the adapter raises for the launch (MissingToolParser, chat_core's
    MissingFilter, MissingEpisodeNormalization, UnsupportedSlime), AppendOnlyChatNeeded when the adapter doesn't
    render each episode append-only, which slime's fully-async worker needs to get one sample per episode, and
    FullyAsyncEvaluation when ``--eval-function-path`` names slime's standard rollout, or an evaluation comes before
    the worker played any episode."""
    api = slime()
    service = AdapterService.of(args)
    if not service.append_only:
        raise AppendOnlyChatNeeded(
            "slime's fully-async rollout takes one sample per episode, which slime_helper gives by rendering each "
            f"episode append-only, and it doesn't here: {APPEND_ONLY_SETTING} is false in --custom-config-path, or "
            "the chat template of --hf-checkpoint can't be rendered append-only (the warning above says why). Leave "
            f"{APPEND_ONLY_SETTING} on with a template that can be, or train with slime's standard rollout (train.py "
            "without --rollout-function-path), which takes an episode of several samples"
        )
    if getattr(args, "eval_datasets", None) and api.load_function(args.eval_function_path) is api.generate_rollout:
        raise FullyAsyncEvaluation(
            f"--eval-function-path {args.eval_function_path} would evaluate on an event loop of its own beside "
            "slime's fully-async worker, and both take slime's GenerateState semaphore, which raises when waited "
            f"for on a second loop; leave --eval-function-path out: {FULLY_ASYNC_ROLLOUT} evaluates with slime's "
            "eval rollout on the worker's loop"
        )
    if evaluation:
        return _evaluated(args, rollout_id)
    keep = api.load_function(args.dynamic_sampling_filter_path)
    drops = api.MetricGatherer()
    kept: list[list] = []
    while (wanted := args.rollout_batch_size - len(kept)) > 0:
        asked = args if wanted == args.rollout_batch_size else Namespace(**{**vars(args), "rollout_batch_size": wanted})
        for group in api.generate_rollout_fully_async(asked, rollout_id, data_source):
            output = api.call_dynamic_filter(keep, args, group)
            if output.keep:
                kept.append(group)
            else:
                drops.on_dynamic_filter_drop(reason=output.reason)
    return api.RolloutFnTrainOutput(samples=kept, metrics=drops.collect())


def takes_one_sample_per_episode(args: Namespace) -> bool:
    """Whether the launch's ``--rollout-function-path`` is ``generate_rollout_fully_async``, which takes one sample
    per episode. Raises UnfilteredFullyAsync when it is slime's fully-async worker itself."""
    api = slime()
    path = getattr(args, "rollout_function_path", None)
    rollout = api.load_function(path) if path else None
    if rollout is api.generate_rollout_fully_async:
        raise UnfilteredFullyAsync(
            f"slime_helper needs --rollout-function-path {FULLY_ASYNC_ROLLOUT} in place of {path}: slime's "
            "fully-async worker never calls --dynamic-sampling-filter-path, so a group holding an episode the env or "
            "the model failed would be trained on its 0.0; slime_helper's function runs the same worker and filters "
            "its groups"
        )
    return rollout is generate_rollout_fully_async


def note_worker_loop() -> None:
    """Note the running event loop as the one slime's fully-async worker plays its training episodes on."""
    _WorkerLoop.current = asyncio.get_running_loop()


def _evaluated(args: Namespace, rollout_id: int) -> Any:
    """slime's eval rollout of ``args``' eval datasets, played on the fully-async worker's event loop."""
    loop = _WorkerLoop.current
    if loop is None or loop.is_closed():
        raise FullyAsyncEvaluation(
            "an evaluation came before slime's fully-async worker played any episode in this process; slime_helper "
            "evaluates on the worker's event loop, where slime's GenerateState semaphore works. Evaluate after the "
            "first step, as train_async.py does (train.py evaluates first unless --skip-eval-before-train)"
        )
    output, _ = asyncio.run_coroutine_threadsafe(slime().eval_rollout(args, rollout_id), loop).result()
    return output
