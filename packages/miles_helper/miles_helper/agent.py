"""Miles' agent function (``--custom-agent-function-path miles_helper.agent.run``) and its abort hook.

Miles' ``agentic_tool_call.generate`` opens a session on its session server, calls the agent with the session's
URL and the row, and turns whatever the model said through that session into training samples. The agent here plays
the row's episode with ``chat_core.play`` against that session and returns the episode's outcome
(``chat_core.EpisodeOutcome`` under ``chat_core.OUTCOME_KEY``) as metadata, which Miles copies onto every sample of
the episode for ``miles_helper.reward``, its filters and its log functions to read. Miles calls ``abort`` beside the
agent when it aborts a rollout; it cancels the episodes still playing in this process, so each closes its env session
and comes back flagged instead of playing on against an aborted model.

The agent takes no Miles arguments, so its limits are fixed when it is made: ``make_agent(limits, env_servers=...)``
makes one with other limits or a pool of env servers, for a module of the user's own that also exports this
``abort``. The one Miles setting it reads is ``--max-seq-len``, the tokens of a session's context, which Miles hands
the agent in the row's metadata as ``max_seq_len``: Miles' session server doesn't bound a session by it (it cuts the
sample to it afterwards), so the episode is cut short where the context reaches it (``Limits.max_context_tokens``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from chat_core import OUTCOME_KEY, ChatEndpoint, EpisodeOutcome, EpisodeResult, Limits, play
from chat_core.env.pool import named_pool

MAX_SEQ_LEN = "max_seq_len"
"""The key of the metadata Miles hands the agent that holds its ``--max-seq-len``, when the launch sets it."""
MODEL = "default"
"""The ``model`` of every chat request. SGLang serves one model whatever the name, and a name with a ``:`` would ask
it for a LoRA adapter, so this is the name Miles' own agents send."""

Agent = Callable[..., Awaitable[dict[str, Any]]]

_playing: set[asyncio.Task[EpisodeResult]] = set()


def make_agent(limits: Limits | None = None, *, env_servers: Sequence[str] = ()) -> Agent:
    """An agent function for ``--custom-agent-function-path`` that plays each episode within ``limits`` (chat_core's
    defaults when None), on the pool
    of env servers ``env_servers`` names (else on the pool ``TRAINER_HELPERS_ENV_SERVERS`` names, else on each row's
    own server; see ``chat_core.play``). Point Miles at it through a module of your own that also exports ``abort``,
    since Miles looks for the abort hook beside the agent: ``from miles_helper.agent import abort, make_agent`` then
    ``run = make_agent(Limits(...))``. Raises ValueError (InvalidServerUrl) when a server URL of ``env_servers``
    isn't an absolute http(s) URL."""
    limits = limits or Limits()
    env_servers = named_pool(env_servers) if env_servers else ()

    async def agent(
        base_url: str,
        prompt: Any,
        request_kwargs: Mapping[str, Any],
        metadata: Mapping[str, Any],
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Play the episode of the row whose ``metadata`` Miles hands over (its ``prompt`` is the same episode's
        first messages, which the env gives again) with the model behind Miles' session at ``base_url``, sending
        ``request_kwargs`` (Miles' sampling settings, SGLang's own keys included) in every request's body.

        Returns the metadata Miles puts on every sample of the episode: the episode's outcome under
        ``chat_core.OUTCOME_KEY`` (its reward, None unless it can be trained on, its flags, counts and seconds) and
        ``agent_metrics.total_tool_time`` (seconds in the env, which Miles counts as time
        spent outside generation). Raises ValueError when ``metadata`` isn't a row written by
        ``chat_core.prepare`` or its ``max_seq_len`` isn't a positive number of tokens, and ServerMismatch when a
        server of the pool ``env_servers`` (or ``TRAINER_HELPERS_ENV_SERVERS``) names serves other tasks; Miles logs it
        and leaves the sample aborted."""
        chat = ChatEndpoint(url=base_url.rstrip("/") + "/v1/chat/completions", model=MODEL)
        bounded = _within_max_seq_len(limits, metadata.get(MAX_SEQ_LEN))
        episode = asyncio.create_task(play(metadata, chat, request_kwargs, bounded, env_servers=env_servers))
        _playing.add(episode)
        try:
            result = await episode
        except asyncio.CancelledError:
            if _aborted(episode):
                return _aborted_outcome()
            raise
        finally:
            _playing.discard(episode)
        return _outcome(result)

    return agent


run = make_agent()
"""The agent with chat_core's default limits: ``--custom-agent-function-path miles_helper.agent.run``."""


async def abort(args: Any) -> None:
    """Miles' abort hook: cancel every episode this process is playing and return once each has closed its env
    session. Each agent then returns its episode's outcome flagged ``rollout_aborted``."""
    episodes = list(_playing)
    for episode in episodes:
        episode.cancel()
    if episodes:
        await asyncio.wait(episodes)


def _within_max_seq_len(limits: Limits, max_seq_len: Any) -> Limits:
    """``limits`` with the context bounded by Miles' ``--max-seq-len`` too, when the launch sets it."""
    if max_seq_len is None:
        return limits
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"Miles' max_seq_len is a positive number of tokens, not {max_seq_len!r}")
    bound = min(max_seq_len, limits.max_context_tokens or max_seq_len)
    return replace(limits, max_context_tokens=bound)


def _aborted(episode: asyncio.Task[EpisodeResult]) -> bool:
    """Whether ``episode`` ended because ``abort`` cancelled it, rather than because the agent itself was."""
    current = asyncio.current_task()
    return episode.cancelled() and (current is None or current.cancelling() == 0)


def _outcome(result: EpisodeResult) -> dict[str, Any]:
    return {
        OUTCOME_KEY: EpisodeOutcome.of(result).to_metadata(),
        "agent_metrics": {"total_tool_time": result.timings.env_s},
    }


def _aborted_outcome() -> dict[str, Any]:
    message = "Miles aborted the rollout while the episode was playing; its env session was closed unscored"
    return {OUTCOME_KEY: EpisodeOutcome.aborted(message).to_metadata()}
