"""slime's generate function for rows of an OpenEnv server's agentenv tasks:

    --custom-generate-function-path slime_helper.generate.generate

Episode bounds are chat_core's defaults unless slime's ``--custom-config-path`` YAML sets ``episode_max_turns``,
``episode_max_tool_calls_per_turn``, ``episode_model_deadline_s``, ``episode_env_call_deadline_s``,
``episode_max_chat_answer_bytes``, ``episode_max_env_message_bytes``, ``episode_max_tool_answer_chars``,
``episode_play_on_cut_reply`` or ``episode_score_cut_short`` (slime puts its keys on ``args``; see
``chat_core.Limits``), and the context is ``--rollout-max-context-len``, which the adapter bounds each prompt by;
``episode_env_servers``, a list of URLs, names the pool of env servers that plays the rows (``chat_core.env.pool``);
``episode_append_only_chat`` overrides the rendering the helper picks from the chat template (``false``: each
turn's whole chat; ``true``: append-only, which makes an episode one sample, or a refusal to start;
``slime_helper.adapter``); ``episode_max_resumed_calls`` bounds how many of an episode's model calls a weight update
may cut and have asked again (``slime_helper.resume``).

Per sample: open a session on the process's adapter → play the row's episode through it (``chat_core.play``) →
``finish_session``: the turns the adapter recorded, as samples carrying the episode's reward, so slime runs no
reward model. A model call a weight update cuts goes on from the cut (``slime_helper.resume``), the episode playing
on. An eval drops the session and returns one sample per episode, and so does an episode whose reply SGLang aborted
while slime's rollout was over (status ABORTED, which slime's fully-async worker plays again) or that a weight update
cut past ``episode_max_resumed_calls`` (FAILED, flagged ``resume_limit``). Under
``slime_helper.generate_rollout_fully_async`` an episode is one sample, not a list, and an episode that raises comes
back as one flagged ``episode_raised``, since slime's worker would only log it. The episode's spans go on the
sample's trace as they happen, and its outcome (``chat_core.EpisodeOutcome``) into every sample's metadata, with a
``turn_not_appended`` flag for each later turn whose prompt couldn't be appended to the tokens the episode held (it
was rendered whole, and slime may have started a new sample there), a ``turn_not_recorded`` flag for each turn the
helper failed to hold for the next one, a ``chat_template_failed`` flag with the template's message where the chat
template couldn't render the chat, and the model calls asked again after a weight update cut them.
"""

from __future__ import annotations

import logging
import uuid
from argparse import Namespace
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from chat_core import OUTCOME_KEY, EpisodeOutcome, EpisodeResult, Flag, FlagKind, Limits, play

from slime_helper._slime import slime
from slime_helper.adapter import AdapterService
from slime_helper.fully_async import LAUNCH_FAULTS, note_launch_fault, note_worker_loop, takes_one_sample_per_episode
from slime_helper.observability import SampleTrace
from slime_helper.resume import Resumed, ResumePolicy, max_resumed_calls
from slime_helper.tokenizers import TurnNotAppended

logger = logging.getLogger(__name__)
_LIMIT_SETTINGS = {
    "episode_max_turns": "max_turns",
    "episode_max_tool_calls_per_turn": "max_tool_calls_per_turn",
    "episode_model_deadline_s": "model_deadline_s",
    "episode_env_call_deadline_s": "env_call_deadline_s",
    "episode_max_chat_answer_bytes": "max_chat_answer_bytes",
    "episode_max_env_message_bytes": "max_env_message_bytes",
    "episode_max_tool_answer_chars": "max_tool_answer_chars",
    "episode_play_on_cut_reply": "play_on_cut_reply",
    "episode_score_cut_short": "score_cut_short",
}
ENV_SERVERS_SETTING = "episode_env_servers"
"""The ``--custom-config-path`` setting naming the pool of env servers that plays the rows."""
_CHAT_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_new_tokens": "max_tokens",
    "stop": "stop",
}


async def generate(
    args: Namespace, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False
) -> list | Any:
    """Play ``sample``'s episode (its metadata is a row's, as ``python -m chat_core.prepare`` writes it) with the
    model slime serves, and return it as slime samples: a list of them, or under
    ``slime_helper.generate_rollout_fully_async`` the one sample slime's fully-async worker takes per episode.

    The samples are the adapter's: one per stretch of turns it could join into one token sequence (one for the
    whole episode when the chat is rendered append-only; a sample per turn when the chat template re-renders earlier
    turns differently, as Qwen3's own does with thinking off), each with the episode's reward (0.0 when it has
    none), the base sample's trace and, in ``metadata``, the row's metadata plus the episode's outcome under
    ``chat_core.OUTCOME_KEY``. A model call a weight update cut is asked again and goes on from the cut, the episode
    playing on in its env session. An episode comes back instead as one placeholder sample with nothing to train
    (``remove_sample``) when SGLang aborted one of its replies while slime's rollout was over (status ABORTED, flagged
    ``reply_aborted``: slime's fully-async worker plays its group again), when a weight update cut more of its model
    calls than ``episode_max_resumed_calls`` (FAILED, flagged ``resume_limit``), when no turn was recorded (status
    FAILED), and under the fully-async rollout when the adapter recorded it as several samples (FAILED, flagged
    ``episode_split``) or when it raised (FAILED, flagged ``episode_raised``; a fault of the launch is also noted for
    ``generate_rollout_fully_async`` to raise). In an eval (``evaluation=True``) the session is dropped and the
    episode comes back as one sample holding its reward with nothing to train, since slime's eval averages over
    samples.

    Raises MissingToolParser without ``--sglang-tool-call-parser``, chat_core's MissingFilter unless
    ``--dynamic-sampling-filter-path`` names one of this helper's filters, MissingEpisodeNormalization without
    ``--custom-reward-post-process-path`` where slime normalises rewards per group, UnreadableToolCalls and
    UnappendableChat where the chat template and the launch don't fit (``AdapterService``), UnfilteredFullyAsync
    under slime's fully-async worker named directly, UnsupportedSlime when slime lacks what the helper uses,
    PartialRolloutRefused with ``--partial-rollout``, and ValueError when the sample's metadata isn't a row's or a
    setting is out of range; a training episode under ``generate_rollout_fully_async`` raises none of these but comes
    back flagged ``episode_raised``. When cancelled, drops the session, closes the episode without running its
    verifiers and re-raises."""
    one_per_episode = takes_one_sample_per_episode(args)
    if evaluation or not one_per_episode:
        return await _played(args, sample, sampling_params, evaluation, one_per_episode)
    note_worker_loop()
    try:
        return await _played(args, sample, sampling_params, evaluation, one_per_episode)
    except Exception as raised:  # slime's worker would only log it, and wait for the group forever
        return _raised(sample, raised)


async def _played(
    args: Namespace, sample: Any, sampling_params: dict[str, Any], evaluation: bool, one_per_episode: bool
) -> list | Any:
    """The episode of ``sample`` played and returned as ``generate`` says, raising as it says."""
    api = slime()
    service = AdapterService.of(args)
    state = api.GenerateState(args)
    sid = f"slime-helper-{uuid.uuid4().hex}"
    service.open_session(
        sid,
        {key: value for key, value in sampling_params.items() if value is not None},
        ResumePolicy(max_resumed_calls(args), rollout_over=lambda: state.aborted),
    )
    try:
        result = await play(
            sample.metadata,
            service.chat(sid),
            _chat_sampling(sampling_params),
            episode_limits(args),
            trace=SampleTrace(sample),
            env_servers=getattr(args, ENV_SERVERS_SETTING, None) or (),
        )
        if (failure := service.template_failure(sid)) is not None:
            result.flags = [_template_flag(flag, failure) for flag in result.flags]
        resumed = service.resumed(sid)
        if resumed.limit is not None:
            result.flags = [_limit_flag(flag, resumed.limit) for flag in result.flags]
        noted = _SessionNotes(service.turns_not_appended(sid), service.unrecorded_turns(sid), resumed)
        aborted = any(flag.kind == FlagKind.REPLY_ABORTED for flag in result.flags)
        played = []
        if not evaluation and not aborted and resumed.limit is None:
            played = await service.adapter.finish_session(
                sid,
                base_sample=sample,
                reward=_reward_of(result),
                extra_metadata=_metadata(sample, _outcome(result, noted)),
            )
            if one_per_episode and len(played) > 1:
                result.flags.append(Flag(FlagKind.EPISODE_SPLIT, _split_message(len(played))))
                played = []
            if (trace := getattr(sample, "trace", None)) is not None:
                for each in played:
                    each.trace = trace
        if not played:
            status = api.Sample.Status
            placeholder = status.COMPLETED if evaluation else status.ABORTED if aborted else status.FAILED
            played = [_untrained(sample, _reward_of(result), _outcome(result, noted), placeholder)]
        if not result.scored:
            logger.warning(
                "%s episode %s is unscored: %s",
                "eval" if evaluation else "train",
                result.episode.task_name,
                "; ".join(f"{flag.kind}: {flag.message}" for flag in result.flags if flag.fatal) or "no reward",
            )
        return played[0] if one_per_episode else played
    finally:
        await service.adapter.drop_session(sid)


def episode_limits(args: Namespace) -> Limits:
    """The bounds of every episode of this launch: chat_core's ``Limits`` with the ``episode_*`` settings slime's
    ``--custom-config-path`` put on ``args``. Raises ValueError when a setting is out of range."""
    chosen = {name: getattr(args, key) for key, name in _LIMIT_SETTINGS.items() if getattr(args, key, None) is not None}
    return Limits(**chosen)


def _chat_sampling(sampling_params: Mapping[str, Any]) -> dict[str, Any]:
    """slime's SGLang sampling settings under the chat request's names; the rest reach SGLang as the session's
    defaults."""
    return {name: sampling_params[key] for key, name in _CHAT_SAMPLING.items() if sampling_params.get(key) is not None}


def _reward_of(result: EpisodeResult) -> float:
    return result.reward if result.scored else 0.0


@dataclass(frozen=True)
class _SessionNotes:
    """What the adapter kept about an episode's session: the turns ``not_appended`` to the tokens of the turn before,
    why each turn it failed to hold for the next one wasn't (``unrecorded``), and the model calls ``resumed`` after a
    weight update cut them."""

    not_appended: list[TurnNotAppended]
    unrecorded: list[str]
    resumed: Resumed


def _outcome(result: EpisodeResult, noted: _SessionNotes) -> EpisodeOutcome:
    """The episode's outcome, with a flag for each turn not appended and turn not recorded of ``noted``, and the
    counts of those and of the resumed calls."""
    outcome = EpisodeOutcome.of(result)
    flags = (
        *(Flag(FlagKind.TURN_NOT_APPENDED, turn.message) for turn in noted.not_appended),
        *(Flag(FlagKind.TURN_NOT_RECORDED, why) for why in noted.unrecorded),
    )
    return replace(
        outcome,
        flags=outcome.flags + flags,
        turns_not_appended=len(noted.not_appended),
        resumed_calls=noted.resumed.calls,
        cut_tokens=noted.resumed.cut_tokens,
    )


def _limit_flag(flag: Flag, limit: str) -> Flag:
    """``flag``, or, for the abort that a weight update cut past ``episode_max_resumed_calls`` ended the episode
    with, why it ended there."""
    return Flag(FlagKind.RESUME_LIMIT, limit) if flag.kind == FlagKind.REPLY_ABORTED else flag


def _raised(sample: Any, raised: Exception) -> Any:
    """The placeholder of an episode that raised ``raised`` under slime's fully-async worker, flagged
    ``episode_raised``, so that its group reaches the rollout function, which raises a fault of the launch (noted
    here) and drops the group otherwise."""
    logger.error("train episode of sample %s raised; it is flagged episode_raised", sample.index, exc_info=raised)
    if isinstance(raised, LAUNCH_FAULTS):
        note_launch_fault(raised)
    message = f"the episode raised {type(raised).__name__}: {raised}"
    outcome = EpisodeOutcome.unplayed(FlagKind.EPISODE_RAISED, message)
    return _untrained(sample, 0.0, outcome, slime().Sample.Status.FAILED)


def _template_flag(flag: Flag, failure: str) -> Flag:
    """``flag``, or, for the chat endpoint's refusal of a chat the template couldn't render, the template's
    ``failure``."""
    return Flag(FlagKind.CHAT_TEMPLATE_FAILED, failure) if flag.kind == FlagKind.SESSION_FAILED else flag


def _metadata(sample: Any, outcome: EpisodeOutcome) -> dict[str, Any]:
    return {**(sample.metadata or {}), OUTCOME_KEY: outcome.to_metadata()}


def _split_message(samples: int) -> str:
    return (
        f"slime's adapter recorded the episode as {samples} samples (a turn's prompt didn't extend the tokens it held; "
        "rendered append-only, a turn_not_appended flag says which and why), and slime's fully-async rollout takes "
        "one sample per episode; it is left out of training with its group"
    )


def _untrained(sample: Any, reward: float, outcome: EpisodeOutcome, status: Any) -> Any:
    """``sample`` as one placeholder token with nothing to train, holding the episode's ``reward`` and flags: slime's
    own agent examples shape their eval and aborted samples this way."""
    sample.tokens = [0, 0]
    sample.response = ""
    sample.response_length = 1
    sample.loss_mask = [0]
    sample.rollout_log_probs = [0.0]
    sample.reward = reward
    sample.remove_sample = True
    sample.status = status
    sample.metadata = _metadata(sample, outcome)
    return sample
