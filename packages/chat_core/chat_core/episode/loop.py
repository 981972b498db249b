"""The episode loop: a row's task played by a model behind an OpenAI-compatible chat endpoint, on the OpenEnv server
that serves it.

Per turn: list the env's tools (a turn's tools are fixed when it opens) → ask the model → run each tool call on
the env and answer it as a ``tool`` message → repeat until the model replies without a tool call (or calls
``end_turn``) → hand the reply to ``end_turn``. The env then opens the next turn, whose prompt becomes a new user
message, or ends the episode with its reward.

Each call waits for its answer before the next is sent, though the server answers a session's calls in order:
uvicorn stops reading a session while a message it received waits for the app, so a call sent behind a slow one
(a long tool, the verifiers) would leave the server's pings unanswered, and past its ping timeout it drops the
session.

Whatever goes wrong ends in an ``EpisodeResult`` carrying a flag with a kind and a message, never in a reward of 0
and never in an exception, except the caller's cancellation. The env session is closed however ``play`` ends, so an
unfinished episode is abandoned on the server without running its verifiers."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from chat_core._wire import described, encoded, excerpt, wire_text
from chat_core.env.errors import CapacityExhausted, EnvCallTimeout, OpenEnvError, ServerMismatch, ServerUnreachable
from chat_core.env.pool import EnvPool, PooledSession, env_servers
from chat_core.env.protocol import Observation
from chat_core.env.session import CapacityWait, EpisodeSession
from chat_core.episode.chat import ChatEndpoint, Reply, UnreadableReply, arguments_of, post, reply_of
from chat_core.limits import Limits
from chat_core.net.http_request import HttpError
from chat_core.prepare.rows import EpisodeRef
from chat_core.record.results import EpisodeResult, Flag, FlagKind, TurnCounts

logger = logging.getLogger(__name__)
END_TURN = "end_turn"
RESERVED_BODY_KEYS = frozenset({"model", "messages", "tools"})
"""The chat body's keys ``play`` sends itself, which the sampling settings may not set."""
_TEXT_LIMIT = 500


class EpisodeTrace(Protocol):
    """Where ``play`` reports the stretches of an episode as they happen, for a trainer's trace viewer: ``reset``,
    ``list_tools``, ``model_call`` (attrs ``turn``), ``tool_call`` (``turn``, ``tool``; on return ``error``) and
    ``end_turn`` (``turn``; on return ``episode_ended``, true when the env ran the verifiers and ended the episode).
    ``span`` opens one with ``attrs``; the loop adds to the dict it yields what it learns by the end."""

    def span(self, name: str, attrs: dict[str, Any]) -> AbstractContextManager[dict[str, Any]]: ...


class _NoTrace:
    """The trace of an episode nobody traces: its spans cost no more than a ``with`` block."""

    def span(self, name: str, attrs: dict[str, Any]) -> _NoSpan:
        return _NO_SPAN


class _NoSpan:
    def __enter__(self) -> dict[str, Any]:
        return {}

    def __exit__(self, *exc_info: object) -> None:
        return None


_NO_SPAN = _NoSpan()


async def play(
    metadata: Mapping[str, Any],
    chat: ChatEndpoint,
    sampling: Mapping[str, Any],
    limits: Limits,
    *,
    trace: EpisodeTrace | None = None,
) -> EpisodeResult:
    """Play the episode of a row's ``metadata`` (a row written by ``python -m chat_core.prepare``, as slime and
    Miles hand it to a rollout) with the model at ``chat``, and return how it went. ``sampling`` goes into every
    chat request's JSON body as it is (e.g. ``temperature``, SGLang's ``top_k``). ``trace`` receives the episode's
    spans as they happen.

    Every failure of the env, the chat endpoint or the model is a flag on the result. Raises ValueError before
    anything starts when ``metadata`` isn't a row's, ``sampling`` sets ``model``, ``messages`` or ``tools``, or the
    chat endpoint's URL or headers can't be sent (see ``ChatEndpoint.request_headers``), and ServerMismatch when a
    server of the launch's pool serves another env or other tasks than the row's. When cancelled, closes the env
    session, so the server abandons the episode without running its verifiers, and re-raises."""
    episode = EpisodeRef.from_metadata(metadata)
    if clash := sorted(RESERVED_BODY_KEYS & set(sampling)):
        raise ValueError(f"sampling sets {', '.join(clash)}, which play sends itself; leave them out")
    game = _Game(episode, chat, dict(sampling), limits, trace or _NoTrace())
    began = time.monotonic()
    session: EpisodeSession | PooledSession
    if servers := env_servers(limits.env_servers):
        pool = EnvPool.of(servers)
        await pool.check(episode)
        session = pool.session(limits)
    else:
        session = EpisodeSession(
            episode.server_url,
            capacity_wait=CapacityWait(total_s=limits.capacity_wait_s),
            call_deadline_s=limits.env_call_deadline_s,
            max_message_bytes=limits.max_env_message_bytes,
        )
    try:
        await game.play(session)
    except ServerMismatch:
        raise
    except EnvCallTimeout as e:
        logger.warning("[chat_core] episode %s: %s; its session was closed", episode.task_name, e)
        game.fail(
            FlagKind.ENV_DEADLINE,
            f"{e} (env_call_deadline_s={limits.env_call_deadline_s:g}); the session was closed, abandoning the "
            "episode unscored",
        )
    except OpenEnvError as e:
        game.fail(_kind_of(e), str(e))
    finally:
        try:
            await game._env(None, session.close())
        finally:
            game.result.timings.capacity_wait_s = session.capacity_wait_s
            game.result.timings.env_s -= session.capacity_wait_s
            game.result.timings.wall_s = time.monotonic() - began
    return game.result


class _Game:
    """The state of one ``play``: the result being built and the limits that bound it.

    Each chat request's body is the whole transcript so far, so it is built from each message's JSON, encoded once
    when the message joins the transcript (``_said``), and each turn's tools, encoded once when the turn opens:
    encoding the transcript anew for every request cost time quadratic in the episode's length."""

    def __init__(
        self, episode: EpisodeRef, chat: ChatEndpoint, sampling: dict[str, Any], limits: Limits, trace: EpisodeTrace
    ):
        self.result = EpisodeResult(episode=episode)
        self._chat = chat
        self._headers = chat.request_headers()
        self._body_head = encoded({**sampling, "model": chat.model})[:-1] + b',"messages":['
        self._said: list[bytes] = []
        self._limits = limits
        self._trace = trace
        self._system_prompt: str | None = None

    def fail(self, kind: FlagKind, message: str) -> None:
        self.result.reward = None
        self.result.flags.append(Flag(kind, message))

    async def play(self, session: EpisodeSession | PooledSession) -> None:
        """Play the episode through, scored or flagged. Each env answer is read in a call that returns before the
        episode waits again, so no answer stays alive across a wait: with a thousand episodes in flight, whatever
        outlives a wait reaches the garbage collector's oldest generation, whose collections go through all of it."""
        playing = await self._first_turn(session)
        while playing:
            playing = self._next_turn(await self._play_turn(session))

    async def _first_turn(self, session: EpisodeSession | PooledSession) -> bool:
        """Start the row's task on ``session`` and open its first turn; False when the episode ended instead (scored
        or flagged)."""
        episode = self.result.episode
        started = await self._env("reset", session.reset(episode.split, episode.index))
        self.result.env_server = session.url
        if started.done:
            self._finish(started)
            return False
        served = (started.task or {}).get("id")
        if served != episode.task_id:
            self.fail(
                FlagKind.TASK_MISMATCH,
                f"task #{episode.index} of split {episode.split!r} is {served!r} on {session.url}, but the "
                f"row is for {episode.task_id!r}: prepare the rows again from the server as it is now",
            )
            return False
        self._open_turn(started.metadata)
        return True

    def _next_turn(self, ended: Observation | None) -> bool:
        """Open the turn that ``ended`` (None: the episode stopped during it) handed over to; False when the episode
        ended instead (scored or flagged)."""
        if ended is None:
            return False
        if ended.done:
            self._finish(ended)
            return False
        if len(self.result.turns) >= self._limits.max_turns:
            self.fail(
                FlagKind.TURN_LIMIT,
                f"the env opened turn {len(self.result.turns) + 1}, past max_turns={self._limits.max_turns}; "
                "the episode was abandoned unscored",
            )
            return False
        opened = ended.body.get("result")
        if not isinstance(opened, dict) or not isinstance(opened.get("prompt"), str):
            self.fail(
                FlagKind.PROTOCOL_ERROR,
                f"end_turn neither ended the episode nor opened a turn: {excerpt(ended.body, _TEXT_LIMIT)}",
            )
            return False
        self._open_turn(opened)
        return True

    def _open_turn(self, prompts: Mapping[str, Any]) -> None:
        """Add the turn's prompt as a user message, after its system prompt when it brings a new one."""
        system_prompt = prompts.get("system_prompt")
        if isinstance(system_prompt, str) and system_prompt and system_prompt != self._system_prompt:
            self._say({"role": "system", "content": system_prompt})
            self._system_prompt = system_prompt
        self._say({"role": "user", "content": str(prompts.get("prompt") or "")})
        self.result.turns.append(TurnCounts())

    async def _play_turn(self, session: EpisodeSession | PooledSession) -> Observation | None:
        """What ``end_turn`` answered, or None when the episode stopped during the turn (flagged)."""
        counts = self.result.turns[-1]
        calls = 0
        tools = await self._tools_of_turn(session)
        if tools is None:
            return None
        while True:
            reply = await self._ask(tools)
            if reply is None:
                return None
            counts.model_calls += 1
            self._say(reply.message)
            if reply.truncated:
                self.result.flags.append(
                    Flag(
                        FlagKind.REPLY_TRUNCATED,
                        f"turn {len(self.result.turns)}: reply {counts.model_calls} was cut at the model's token limit "
                        "(finish_reason 'length'); it was played as it came",
                    )
                )
            if not reply.tool_calls:
                return await self._end_turn(session, reply.text)
            for position, call in enumerate(reply.tool_calls):
                name = call["function"]["name"]
                arguments = arguments_of(call["function"].get("arguments"))
                if name == END_TURN and isinstance(arguments, dict):
                    response = arguments.get("response", reply.text)
                    if isinstance(response, str):
                        self._answer(call, "Your turn has ended.")
                        self._skip(reply.tool_calls[position + 1 :], "the turn had already ended")
                        return await self._end_turn(session, response)
                    arguments = (
                        f'end_turn takes {{"response": string}}, not a response of {excerpt(response, _TEXT_LIMIT)}'
                    )
                if calls >= self._limits.max_tool_calls_per_turn:
                    self.result.flags.append(
                        Flag(
                            FlagKind.TOOL_CALL_LIMIT,
                            f"turn {len(self.result.turns)}: the model called more than max_tool_calls_per_turn="
                            f"{self._limits.max_tool_calls_per_turn} tools; the turn was ended with its latest text",
                        )
                    )
                    self._skip(reply.tool_calls[position:], "the turn's tool-call limit was reached")
                    return await self._end_turn(session, reply.text)
                calls += 1
                counts.tool_calls += 1
                if isinstance(arguments, str):
                    counts.tool_errors += 1
                    self.result.flags.append(
                        Flag(
                            FlagKind.BAD_TOOL_ARGUMENTS,
                            f"turn {len(self.result.turns)}: {name}: {arguments}; answered as a tool error",
                        )
                    )
                    self._answer(call, f"error: {arguments}")
                    continue
                with self._trace.span("tool_call", {"turn": len(self.result.turns), "tool": name}) as end:
                    answered = await self._call_tool(session, name, arguments)
                    if answered is None:
                        return None
                    text, failed = answered
                    end["error"] = failed
                counts.tool_errors += failed
                self._answer(call, text)

    async def _tools_of_turn(self, session: EpisodeSession | PooledSession) -> bytes | None:
        """The turn's tools, encoded as the end of a chat body, or None when the env ended the episode instead."""
        listed = await self._env("list_tools", session.list_tools())
        if listed.done:
            self._finish(listed)
            return None
        return b'],"tools":' + encoded([tool.as_openai() for tool in listed.tools]) + b"}"

    async def _call_tool(
        self, session: EpisodeSession | PooledSession, name: str, arguments: dict[str, Any]
    ) -> tuple[str, bool] | None:
        """The text the tool call answers the model with and whether it failed, or None when the env ended the
        episode instead."""
        answered = await self._env(None, session.call_tool(name, arguments))
        if answered.done:
            self._finish(answered)
            return None
        return _tool_answer(answered)

    async def _end_turn(self, session: EpisodeSession | PooledSession, response: str) -> Observation:
        with self._trace.span(END_TURN, {"turn": len(self.result.turns)}) as end:
            ended = await self._env(None, session.call_tool(END_TURN, {"response": response}))
            end["episode_ended"] = ended.done
        return ended

    async def _ask(self, tools: bytes) -> Reply | None:
        """The model's reply, or None when the chat failed or the deadline passed (flagged). ``tools`` is the
        body's end: its tools, encoded."""
        left = self._limits.model_deadline_s - self.result.timings.model_s
        body = b"".join((self._body_head, b",".join(self._said), tools))
        began = time.monotonic()
        try:
            with self._trace.span("model_call", {"turn": len(self.result.turns)}):
                async with asyncio.timeout(left):
                    answer = await post(
                        self._chat,
                        self._headers,
                        body,
                        deadline=began + left,
                        max_answer_bytes=self._limits.max_chat_answer_bytes,
                        retried=self._retried,
                    )
        except TimeoutError:
            self.fail(
                FlagKind.MODEL_DEADLINE,
                f"the model took more than model_deadline_s={self._limits.model_deadline_s} s in all; the episode "
                f"was abandoned in turn {len(self.result.turns)}",
            )
            return None
        except HttpError as e:
            self.fail(
                FlagKind.SESSION_FAILED,
                f"the chat request to {self._chat.url} failed: {described(e)}{self._retries()}",
            )
            return None
        finally:
            self.result.timings.model_s += time.monotonic() - began
        if answer.status >= 400:
            self.fail(
                FlagKind.SESSION_FAILED,
                f"the chat endpoint {self._chat.url} answered HTTP {answer.status}: "
                f"{excerpt(wire_text(answer.body), _TEXT_LIMIT)}{self._retries()}",
            )
            return None
        try:
            return reply_of(answer.body, len(self.result.transcript))
        except UnreadableReply as e:
            self.fail(FlagKind.SESSION_FAILED, f"the chat endpoint {self._chat.url} {e}")
            return None

    def _retried(self) -> None:
        self.result.model_retries += 1

    def _retries(self) -> str:
        retries = self.result.model_retries
        return f" ({retries} chat request(s) of the episode sent again before giving up)" if retries else ""

    async def _env(self, span: str | None, call: Any) -> Any:
        """``call``'s observation, its time counted as the env's, in a trace span of its own when ``span`` names
        one (a caller that adds attributes opens the span itself)."""
        began = time.monotonic()
        try:
            if span is None:
                return await call
            with self._trace.span(span, {"turn": len(self.result.turns)}):
                return await call
        finally:
            self.result.timings.env_s += time.monotonic() - began

    def _say(self, message: dict[str, Any]) -> None:
        self.result.transcript.append(message)
        self._said.append(encoded(message))

    def _answer(self, call: dict[str, Any], content: str) -> None:
        self._say({"role": "tool", "tool_call_id": call["id"], "content": content})

    def _skip(self, calls: list[dict[str, Any]], why: str) -> None:
        for call in calls:
            self._answer(call, f"error: not run: {why}")

    def _finish(self, ended: Observation) -> None:
        """Score an episode the env ended, or flag why it can't be."""
        if ended.error is not None:
            return self.fail(FlagKind.ENV_FAILED, ended.error)
        reward = ended.reward
        if reward is None or not math.isfinite(reward):
            scores = ended.metadata.get("scores")
            return self.fail(
                FlagKind.NO_REWARD,
                f"the env ended the episode with reward {reward!r}" + (f" (scores {scores})" if scores else ""),
            )
        self.result.reward = float(reward)
        return None


def _tool_answer(answered: Observation) -> tuple[str, bool]:
    """The text a tool message gives the model, and whether the call failed."""
    error = answered.body.get("error")
    if isinstance(error, dict):
        return f"error ({error.get('error_type', 'error')}): {error.get('message', '')}", True
    result = answered.body.get("result")
    if isinstance(result, dict):
        if isinstance(result.get("data"), str):
            return result["data"], bool(result.get("is_error"))
        parts = result.get("content")
        if isinstance(parts, list):
            text = "".join(str(part.get("text") or "") for part in parts if isinstance(part, dict))
            return text, bool(result.get("is_error"))
    return encoded(result).decode(), False


def _kind_of(error: OpenEnvError) -> FlagKind:
    if isinstance(error, CapacityExhausted):
        return FlagKind.CAPACITY_EXHAUSTED
    if isinstance(error, ServerUnreachable):
        return FlagKind.ENV_UNREACHABLE
    return FlagKind.PROTOCOL_ERROR
