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
drop as ``rollout/dynamic_filter/drop_<reason>``, each round logged with its drops, and raises ``RolloutStarved``
naming the drops once it has drawn ``fully_async_max_drawn_batches`` batches' worth of groups without enough kept;
applies ``--rollout-sample-filter-path`` and ``--rollout-all-samples-process-path`` as slime's standard rollout does;
raises a fault of the launch that an episode raised (``LAUNCH_FAULTS``), which slime's worker would only log; and
evaluates with slime's own eval rollout on the event loop the worker plays on, since both take slime's
``GenerateState`` semaphore, which works on one loop only (waiting for it on another raises). Within it
``slime_helper.generate`` returns one sample per episode, a model call that a weight update cuts goes on from the cut
in the same env session (``slime_helper.resume``), and an episode that raises comes back flagged ``episode_raised``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from argparse import Namespace
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

from chat_core import MissingFilter, ServerMismatch
from chat_core.record.filters import episodes_of

from slime_helper._slime import slime
from slime_helper.adapter import APPEND_ONLY_SETTING, AdapterService
from slime_helper.errors import (
    AppendOnlyChatNeeded,
    FullyAsyncEvaluation,
    RolloutStarved,
    SlimeSetupError,
    UnfilteredFullyAsync,
)
from slime_helper.resume import max_resumed_calls

logger = logging.getLogger(__name__)
FULLY_ASYNC_ROLLOUT = "slime_helper.generate_rollout_fully_async"
"""The ``--rollout-function-path`` of a fully-async launch with this helper."""
MAX_DRAWN_BATCHES_SETTING = "fully_async_max_drawn_batches"
"""The ``--custom-config-path`` setting bounding the groups one rollout call draws from slime's worker, in batches of
``--rollout-batch-size``."""
DEFAULT_MAX_DRAWN_BATCHES = 10
"""A rollout call gives up once the filter has kept less than a tenth of the groups it needed."""
LAUNCH_FAULTS = (SlimeSetupError, MissingFilter, ServerMismatch)
"""What an episode raises because the launch can't train as it is (the helper's refusals, a pool of env servers that
doesn't serve the rows): raised from the rollout function, as slime's standard rollout would raise it."""


class _LaunchFaults:
    """The faults of the launch that episodes raised under slime's worker, for the rollout function to raise."""

    noted: ClassVar[list[Exception]] = []
    lock = threading.Lock()


class _WorkerLoop:
    """The event loop slime's fully-async worker last played a training episode of this process on."""

    current: asyncio.AbstractEventLoop | None = None


def generate_rollout_fully_async(args: Namespace, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's ``--rollout-function-path``: ``--rollout-batch-size`` groups from slime's fully-async worker that the
    launch's dynamic filter keeps, with the filter's drop counts as the rollout's metrics; with ``evaluation``,
    slime's eval rollout, played on the worker's event loop.

    Raises, before any episode plays, what the adapter raises for the launch (MissingToolParser, chat_core's
    MissingFilter, MissingEpisodeNormalization, PartialRolloutRefused, UnsupportedSlime), AppendOnlyChatNeeded when
    the adapter doesn't render each episode append-only, which slime's fully-async worker needs to get one sample per
    episode, FullyAsyncEvaluation when ``--eval-function-path`` names slime's standard rollout, or an evaluation comes
    before the worker played any episode, and ValueError when ``episode_max_resumed_calls`` or
    ``fully_async_max_drawn_batches`` is out of range. Then raises what an episode raised for the launch
    (``LAUNCH_FAULTS``), and RolloutStarved, naming the drops, once it has drawn ``fully_async_max_drawn_batches``
    times ``--rollout-batch-size`` groups without enough kept."""
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
    max_resumed_calls(args)
    batches = max_drawn_batches(args)
    if evaluation:
        return _evaluated(args, rollout_id)
    keep = api.load_function(args.dynamic_sampling_filter_path)
    drops = api.MetricGatherer()
    dropped: Counter[str] = Counter()
    kept: list[list] = []
    drawn: list[list] = []
    while (wanted := args.rollout_batch_size - len(kept)) > 0:
        if len(drawn) >= batches * args.rollout_batch_size:
            raise RolloutStarved(_starved(args, rollout_id, batches, len(drawn), len(kept), dropped))
        asked = args if wanted == args.rollout_batch_size else Namespace(**{**vars(args), "rollout_batch_size": wanted})
        handed_back = api.generate_rollout_fully_async(asked, rollout_id, data_source)
        _raise_launch_fault()
        round_drops: Counter[str] = Counter()
        for group in handed_back:
            output = api.call_dynamic_filter(keep, args, group)
            if output.keep:
                kept.append(group)
            else:
                drops.on_dynamic_filter_drop(reason=output.reason)
                round_drops[output.reason] += 1
        drawn += handed_back
        dropped += round_drops
        logger.info(
            "[slime_helper] fully-async rollout %d: the filter kept %d of %d groups (%d of %d kept, %d drawn); %s",
            rollout_id,
            len(handed_back) - round_drops.total(),
            len(handed_back),
            len(kept),
            args.rollout_batch_size,
            len(drawn),
            f"dropped {_counted(round_drops)}" if round_drops else "none dropped",
        )
    _log_resumes(rollout_id, drawn)
    kept.sort(key=_first_index)
    if args.rollout_sample_filter_path is not None:
        api.load_function(args.rollout_sample_filter_path)(args, kept)
    if args.rollout_all_samples_process_path is not None:
        api.load_function(args.rollout_all_samples_process_path)(
            args, sorted(drawn, key=_first_index), data_source.get_samples
        )
    return api.RolloutFnTrainOutput(samples=kept, metrics=drops.collect())


def max_drawn_batches(args: Namespace) -> int:
    """The launch's ``fully_async_max_drawn_batches``: the default unless ``--custom-config-path`` sets it. Raises
    ValueError when it isn't a whole number, 1 or more."""
    value = getattr(args, MAX_DRAWN_BATCHES_SETTING, None)
    if value is None:
        return DEFAULT_MAX_DRAWN_BATCHES
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{MAX_DRAWN_BATCHES_SETTING} is a number of batches, 1 or more, not {value!r}")
    return value


def note_launch_fault(fault: Exception) -> None:
    """Note ``fault``, which an episode raised because the launch can't train, for the rollout function to raise."""
    with _LaunchFaults.lock:
        _LaunchFaults.noted.append(fault)


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


def _raise_launch_fault() -> None:
    """Raise the first fault of the launch an episode raised since the last one raised, if any."""
    with _LaunchFaults.lock:
        faults, _LaunchFaults.noted = _LaunchFaults.noted, []
    if faults:
        raise faults[0]


def _starved(args: Namespace, rollout_id: int, batches: int, drawn: int, kept: int, dropped: Counter[str]) -> str:
    return (
        f"fully-async rollout {rollout_id} drew {drawn} groups from slime's worker and "
        f"{args.dynamic_sampling_filter_path} kept {kept} of the {args.rollout_batch_size} it needs, past "
        f"{MAX_DRAWN_BATCHES_SETTING}={batches} batches of --rollout-batch-size; dropped "
        f"{_counted(dropped)}. A reason is the kind of an episode's first fatal flag (docs/EPISODE_RECORD.md says what "
        "each means and what to do; the warnings above name each episode's), sample_aborted, no_episode_outcome, or "
        "same_reward_<reward> (every episode of a group earned it, which teaches GRPO nothing: tasks nearer the "
        f"model's reach, or more samples per prompt, help). Fix what they name, or raise {MAX_DRAWN_BATCHES_SETTING} "
        "in --custom-config-path where that many drops are expected"
    )


def _counted(reasons: Counter[str]) -> str:
    return ", ".join(f"{reason} x{count}" for reason, count in reasons.most_common())


def _log_resumes(rollout_id: int, groups: Sequence[list]) -> None:
    """Log how many of the model calls of ``groups``' episodes weight updates cut, when any."""
    outcomes = [
        episode.outcome
        for group in groups
        for episode in episodes_of(group, slime().Sample.Status.ABORTED)
        if episode.outcome is not None
    ]
    if resumed := sum(outcome.resumed_calls for outcome in outcomes):
        logger.info(
            "[slime_helper] fully-async rollout %d: weight updates cut %d model calls of its %d episodes, each asked "
            "again and gone on from the %d tokens cut in all",
            rollout_id,
            resumed,
            len(outcomes),
            sum(outcome.cut_tokens for outcome in outcomes),
        )


def _first_index(group: list) -> int:
    return group[0].index


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
