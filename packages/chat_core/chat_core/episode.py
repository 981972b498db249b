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
import json
import math
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from chat_core._http import ConnectionRefused, HttpError, Route
from chat_core._wire import described, encoded, parse_json, wire_text
from chat_core.errors import CapacityExhausted, EnvCallTimeout, OpenEnvError, ServerMismatch, ServerUnreachable
from chat_core.openenv_client import CapacityWait, EpisodeSession, Observation, server_url
from chat_core.pool import EnvPool, PooledSession, env_servers
from chat_core.retry import RetryPolicy
from chat_core.rows import EpisodeRef

END_TURN = "end_turn"
_RESERVED_BODY_KEYS = frozenset({"model", "messages", "tools"})
_ERROR_TEXT_LIMIT = 500
_RETRY = RetryPolicy()


class FlagKind(StrEnum):
    """What went wrong in an episode. Noted while the episode goes on:

    - ``bad_tool_arguments``: a tool call's arguments weren't a JSON object; the model got a tool error instead.
    - ``tool_call_limit``: the model called more tools in a turn than allowed; the turn ended with its latest text.
    - ``reply_truncated``: a reply stopped at the model's token limit (finish reason ``length``); it was played as
      it came, so the reward may be for a cut answer or a cut tool call.

    Fatal (in ``FATAL``), leaving the episode unscored:

    - ``env_failed``: the env's run failed (at reset, in a turn or in a verifier); the message is the server's.
    - ``session_failed``: the chat endpoint failed: an HTTP error, no connection, an aborted or unreadable reply
      (429, 502, 503, 504 and refused connections only once retrying them would pass the model deadline).
    - ``no_reward``: the env ended the episode without a reward.
    - ``model_deadline``: the model took longer than ``Limits.model_deadline_s`` in all.
    - ``turn_limit``: the env opened more turns than ``Limits.max_turns``.
    - ``capacity_exhausted``: the env server stayed full for ``Limits.capacity_wait_s``.
    - ``env_deadline``: an env call (reset, list_tools, a tool call, end_turn with its verifiers) went unanswered
      for ``Limits.env_call_deadline_s``; the session was closed, abandoning the episode.
    - ``env_unreachable``: the env server couldn't be reached.
    - ``protocol_error``: the env server answered outside the protocol, or dropped the session.
    - ``task_mismatch``: the server serves another task at the row's place; the rows are stale.
    - ``rollout_aborted``: the trainer aborted the rollout while the episode was playing (a helper's flag; ``play``
      itself is cancelled then)."""

    BAD_TOOL_ARGUMENTS = "bad_tool_arguments"
    TOOL_CALL_LIMIT = "tool_call_limit"
    REPLY_TRUNCATED = "reply_truncated"
    ENV_FAILED = "env_failed"
    SESSION_FAILED = "session_failed"
    NO_REWARD = "no_reward"
    MODEL_DEADLINE = "model_deadline"
    TURN_LIMIT = "turn_limit"
    CAPACITY_EXHAUSTED = "capacity_exhausted"
    ENV_DEADLINE = "env_deadline"
    ENV_UNREACHABLE = "env_unreachable"
    PROTOCOL_ERROR = "protocol_error"
    TASK_MISMATCH = "task_mismatch"
    ROLLOUT_ABORTED = "rollout_aborted"


FATAL = frozenset(FlagKind) - {FlagKind.BAD_TOOL_ARGUMENTS, FlagKind.TOOL_CALL_LIMIT, FlagKind.REPLY_TRUNCATED}


@dataclass(frozen=True)
class Flag:
    """Something that went wrong in an episode, with what a person needs to find it."""

    kind: FlagKind
    message: str

    @property
    def fatal(self) -> bool:
        return self.kind in FATAL

    def as_dict(self) -> dict[str, Any]:
        """The flag as plain JSON data, the shape trainers keep in a sample's metadata."""
        return {"kind": str(self.kind), "message": self.message, "fatal": self.fatal}


@dataclass(frozen=True)
class ChatEndpoint:
    """Where the model answers: ``url`` is a full ``.../v1/chat/completions`` URL, ``model`` the body's model name,
    and ``headers`` go with every request (e.g. ``Authorization: Bearer <session id>``)."""

    url: str
    model: str
    headers: Mapping[str, str] = field(default_factory=dict)

    def route(self) -> Route:
        """Its chat requests' route: JSON bodies with ``headers``. Raises ValueError as ``chat_core._http.Route``
        does."""
        return Route("POST", self.url, {"Content-Type": "application/json", **self.headers})


@dataclass(frozen=True)
class Limits:
    """How the launch plays each episode: its bounds, and the env servers that serve it. ``max_turns``: env turns
    played; one more ends it unscored. ``max_tool_calls_per_turn``: tool calls the model makes in a turn; one more
    ends the turn with the model's latest text. ``model_deadline_s``: seconds the episode may spend waiting for the
    model, all calls together. ``capacity_wait_s``: seconds to wait for a free env session while the server (every
    server of the pool) is full. ``env_call_deadline_s``: seconds one env call may go unanswered (reset, list_tools,
    a tool call, end_turn with the verifiers it runs), so a stuck env can't hold an episode. ``env_servers``: the
    URLs of a pool of env servers serving the rows' bundle, which plays every row instead of the server it was
    prepared from (``chat_core.pool``); when empty, the ``TRAINER_HELPERS_ENV_SERVERS`` environment variable names
    the pool (comma-separated), and without it each row plays on its own server. Raises ValueError when a bound is
    out of range or a server URL isn't an absolute http(s) URL."""

    max_turns: int = 16
    max_tool_calls_per_turn: int = 32
    model_deadline_s: float = 900.0
    capacity_wait_s: float = 600.0
    env_call_deadline_s: float = 600.0
    env_servers: Sequence[str] = ()

    def __post_init__(self) -> None:
        if isinstance(self.env_servers, str):
            raise ValueError(f"env_servers is a list of server URLs, not the one string {self.env_servers!r}")
        object.__setattr__(self, "env_servers", tuple(server_url(url) for url in self.env_servers))
        if self.max_turns < 1 or self.max_tool_calls_per_turn < 1:
            raise ValueError(f"{self}: max_turns and max_tool_calls_per_turn must be at least 1")
        if not self.model_deadline_s > 0 or not self.env_call_deadline_s > 0 or not self.capacity_wait_s >= 0:
            raise ValueError(
                f"{self}: model_deadline_s and env_call_deadline_s must be positive and capacity_wait_s not negative"
            )


@dataclass
class TurnCounts:
    """One env turn: the model's replies, the tool calls answered (``end_turn`` aside) and how many of them were
    errors (the env's, or arguments refused before reaching it)."""

    model_calls: int = 0
    tool_calls: int = 0
    tool_errors: int = 0


@dataclass
class Timings:
    """Seconds spent: inside env calls (``env_s``: connecting, or taking a parked session, every step, and closing or
    parking the session, waiting for a free session aside), waiting for the model (``model_s``: every chat request),
    waiting for a free env session (``capacity_wait_s``), and in all (``wall_s``); the event loop's connections are
    opened inside whichever of these first needs them. What ``wall_s`` holds beyond the other three is the loop's own
    work."""

    env_s: float = 0.0
    model_s: float = 0.0
    capacity_wait_s: float = 0.0
    wall_s: float = 0.0


@dataclass
class EpisodeResult:
    """How an episode went: its reward (None unless the env scored it and nothing fatal happened), its flags, the
    chat as the model saw it (tool messages included), each turn's counts, the episode's timings, and how many chat
    requests were sent again after a transient failure (``model_retries``, see ``chat_core.retry``).
    ``env_server`` is the URL of the server that played it (the row's own, or the pool's server it was routed to),
    None when no server started it."""

    episode: EpisodeRef
    env_server: str | None = None
    reward: float | None = None
    flags: list[Flag] = field(default_factory=list)
    transcript: list[dict[str, Any]] = field(default_factory=list)
    turns: list[TurnCounts] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    model_retries: int = 0

    @property
    def scored(self) -> bool:
        """Whether the reward can be trained on: the env gave one and no fatal flag was raised."""
        return self.reward is not None and not any(flag.fatal for flag in self.flags)


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
    chat endpoint's URL or headers can't be sent (see ``chat_core._http.Route``), and
    ServerMismatch when a server of the launch's pool serves another env or other tasks than the row's. When
    cancelled, closes the env session, so the server abandons the episode without running its verifiers, and
    re-raises."""
    episode = EpisodeRef.from_metadata(metadata)
    if clash := sorted(_RESERVED_BODY_KEYS & set(sampling)):
        raise ValueError(f"sampling sets {', '.join(clash)}, which play sends itself; leave them out")
    game = _Game(episode, chat, dict(sampling), limits, trace or _NoTrace())
    began = time.monotonic()
    session: EpisodeSession | PooledSession
    if servers := env_servers(limits.env_servers):
        pool = EnvPool.of(servers)
        await pool.check(episode)
        session = pool.session(limits.capacity_wait_s, limits.env_call_deadline_s)
    else:
        session = EpisodeSession(
            episode.server_url,
            capacity_wait=CapacityWait(total_s=limits.capacity_wait_s),
            call_deadline_s=limits.env_call_deadline_s,
        )
    try:
        await game.play(session)
    except ServerMismatch:
        raise
    except EnvCallTimeout as e:
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


@dataclass(frozen=True)
class _Reply:
    """The model's answer, as the transcript keeps it, with its text and tool calls read out, and whether it was cut
    at the model's token limit."""

    message: dict[str, Any]
    text: str
    tool_calls: list[dict[str, Any]]
    truncated: bool


class _ChatFailed(Exception):
    """The chat endpoint's answer can't be read as a chat completion."""


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
        self._route = chat.route()
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
                f"end_turn neither ended the episode nor opened a turn: {_clipped(json.dumps(ended.body))}",
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
                arguments = _arguments_of(call["function"].get("arguments"))
                if name == END_TURN and isinstance(arguments, dict):
                    response = arguments.get("response", reply.text)
                    if isinstance(response, str):
                        self._answer(call, "Your turn has ended.")
                        self._skip(reply.tool_calls[position + 1 :], "the turn had already ended")
                        return await self._end_turn(session, response)
                    arguments = f'end_turn takes {{"response": string}}, not a response of {_clipped(response)}'
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

    async def _ask(self, tools: bytes) -> _Reply | None:
        """The model's reply, or None when the chat failed or the deadline passed (flagged). ``tools`` is the
        body's end: its tools, encoded."""
        left = self._limits.model_deadline_s - self.result.timings.model_s
        body = b"".join((self._body_head, b",".join(self._said), tools))
        began = time.monotonic()
        try:
            with self._trace.span("model_call", {"turn": len(self.result.turns)}):
                async with asyncio.timeout(left):
                    status, raw = await self._post(body, began + left)
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
                f"the chat request to {self._chat.url} failed: {described(e)}{self._retried()}",
            )
            return None
        finally:
            self.result.timings.model_s += time.monotonic() - began
        if status >= 400:
            self.fail(
                FlagKind.SESSION_FAILED,
                f"the chat endpoint {self._chat.url} answered HTTP {status}: {_clipped(wire_text(raw))}"
                f"{self._retried()}",
            )
            return None
        try:
            return _reply_of(raw, len(self.result.transcript))
        except _ChatFailed as e:
            self.fail(FlagKind.SESSION_FAILED, f"the chat endpoint {self._chat.url} {e}")
            return None

    async def _post(self, body: bytes, deadline: float) -> tuple[int, bytes]:
        """The chat endpoint's status and body for ``body``, sent again while ``_RETRY`` says a transient failure is
        worth waiting out before the monotonic ``deadline``; the last answer, or failure, once it isn't."""
        attempt = 0
        while True:
            try:
                answer = await self._route.send(body)
            except ConnectionRefused:
                if (wait := _RETRY.delay(attempt, None, None, deadline - time.monotonic())) is None:
                    raise
            else:
                retry_after = answer.headers.get("retry-after")
                if (wait := _RETRY.delay(attempt, answer.status, retry_after, deadline - time.monotonic())) is None:
                    return answer.status, answer.body
            attempt += 1
            self.result.model_retries += 1
            await asyncio.sleep(wait)

    def _retried(self) -> str:
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


def _reply_of(raw: bytes, seen: int) -> _Reply:
    """The reply in a chat completion; raises _ChatFailed saying what is wrong with it. Tool calls without an id get
    one, unique in the episode, so each can be answered."""
    try:
        completion = parse_json(raw)
    except ValueError as e:
        raise _ChatFailed(f"answered with something that isn't JSON ({e}): {_clipped(wire_text(raw))}") from None
    choices = completion.get("choices") if isinstance(completion, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise _ChatFailed(f"answered without a choice holding a message: {_clipped(wire_text(raw))}")
    if choice.get("finish_reason") == "abort":
        raise _ChatFailed("aborted the reply (finish_reason 'abort')")
    text = _text_of(message.get("content"))
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list) or not all(
        isinstance(call, dict)
        and isinstance(call.get("function"), dict)
        and isinstance(call["function"].get("name"), str)
        for call in calls
    ):
        raise _ChatFailed(f"answered with tool calls that aren't OpenAI tool calls: {_clipped(json.dumps(calls))}")
    calls = [
        call if isinstance(call.get("id"), str) and call["id"] else {**call, "id": f"call_{seen}_{position}"}
        for position, call in enumerate(calls)
    ]
    kept = {key: value for key, value in message.items() if value is not None}
    kept["role"] = "assistant"
    if calls:
        kept["tool_calls"] = calls
    else:
        kept.pop("tool_calls", None)
    return _Reply(message=kept, text=text, tool_calls=calls, truncated=choice.get("finish_reason") == "length")


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        return "".join(str(part.get("text") or "") for part in content if part.get("type") == "text")
    raise _ChatFailed(f"answered with content that is neither text nor text parts: {_clipped(json.dumps(content))}")


def _arguments_of(raw: Any) -> dict[str, Any] | str:
    """A tool call's arguments as an object, or why they aren't one. No arguments at all read as ``{}``."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        return f"the arguments must be a JSON object, not {type(raw).__name__}"
    try:
        parsed = parse_json(raw)
    except ValueError as e:
        return f"the arguments aren't valid JSON ({e}): {_clipped(raw)}"
    if not isinstance(parsed, dict):
        return f"the arguments must be a JSON object, not {_clipped(raw)}"
    return parsed


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
    return json.dumps(result), False


def _kind_of(error: OpenEnvError) -> FlagKind:
    if isinstance(error, CapacityExhausted):
        return FlagKind.CAPACITY_EXHAUSTED
    if isinstance(error, ServerUnreachable):
        return FlagKind.ENV_UNREACHABLE
    return FlagKind.PROTOCOL_ERROR


def _clipped(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _ERROR_TEXT_LIMIT else text[:_ERROR_TEXT_LIMIT] + "…"
