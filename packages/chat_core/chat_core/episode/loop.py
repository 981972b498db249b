"""The episode loop: a row's task played by a model behind an OpenAI-compatible chat endpoint, on the OpenEnv server
that serves it.

Per turn: list the env's tools (a turn's tools are fixed when it opens) → ask the model → run each tool call on
the env and answer it as a ``tool`` message → repeat until the model replies without a tool call (or calls
``end_turn``) → hand the reply to ``end_turn``. The env then opens the next turn, whose prompt becomes a new user
message, or ends the episode with its reward. A tool answer longer than ``Limits.max_tool_answer_chars`` is cut. The
chat side (the transcript, asking the model) is ``chat_core.episode.conversation``'s; this module plays the turns on
the env.

An episode whose next prompt doesn't fit the model's context, or (unless ``Limits.play_on_cut_reply``) whose reply
was cut at the model's token limit, is cut short there: no further model call, tool call or env turn. As
``Limits.score_cut_short`` says, it ends unscored without the env's verifiers, or its turn is handed to the env with
the latest reply's text and the env's score taken, when the env ends the episode there rather than open another
turn.

Whatever goes wrong ends in an ``EpisodeResult`` carrying a flag with a kind and a message, never in a reward of 0
and never in an exception, except the caller's cancellation. The env session is closed however ``play`` ends, so an
unfinished episode is abandoned on the server without running its verifiers."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

from chat_core._wire import FLAG_EXCERPT, encoded, excerpt
from chat_core.env.pool import EnvPool, PooledSession, named_pool
from chat_core.env.protocol import Observation
from chat_core.env.session import CapacityWait, EpisodeSession
from chat_core.episode.chat import ChatEndpoint, Reply, arguments_of
from chat_core.episode.conversation import ContextFull, Conversation, check_sampling
from chat_core.episode.tracing import NO_TRACE, EpisodeTrace
from chat_core.episode_ref import EpisodeRef
from chat_core.errors import CapacityExhausted, EnvCallTimeout, OpenEnvError, ServerMismatch, ServerUnreachable
from chat_core.limits import Limits
from chat_core.record.results import EpisodeResult, FlagKind, TurnCounts

logger = logging.getLogger(__name__)
END_TURN = "end_turn"
TOOL_ANSWER_CUT = "\n[the tool's answer is cut here: {characters:,} more characters, past the {cap:,} shown]"
"""What follows a tool answer cut to ``Limits.max_tool_answer_chars``, for the model to see."""

Session = EpisodeSession | PooledSession


async def play(
    metadata: Mapping[str, Any],
    chat: ChatEndpoint,
    sampling: Mapping[str, Any],
    limits: Limits,
    *,
    trace: EpisodeTrace | None = None,
    env_servers: Sequence[str] = (),
) -> EpisodeResult:
    """Play the episode of a row's ``metadata`` (a row written by ``python -m chat_core.prepare``, as slime and
    Miles hand it to a rollout) with the model at ``chat``, and return how it went. ``sampling`` goes into every
    chat request's JSON body as it is (e.g. ``temperature``, SGLang's ``top_k``). ``trace`` receives the episode's
    spans as they happen. ``env_servers`` names a pool of env servers serving the rows' bundle, which plays the row
    instead of the server it was prepared from (``chat_core.env.pool``); when empty, the ``TRAINER_HELPERS_ENV_SERVERS``
    environment variable names the pool (comma-separated), and without it the row plays on its own server.

    Every failure of the env, the chat endpoint or the model is a flag on the result. Raises ValueError before
    anything starts when ``metadata`` isn't a row's, ``sampling`` sets ``model``, ``messages`` or ``tools``, or the
    chat endpoint's URL or headers can't be sent (see ``ChatEndpoint.request_headers``), InvalidServerUrl (a
    ValueError) when a server of the pool isn't an absolute http(s) URL, and ServerMismatch when a
    server of the launch's pool serves another env or other tasks than the row's. When cancelled, closes the env
    session, so the server abandons the episode without running its verifiers, and re-raises."""
    episode = EpisodeRef.from_metadata(metadata)
    check_sampling(sampling)
    game = _Episode(episode, chat, sampling, limits, trace or NO_TRACE)
    began = time.monotonic()
    session: Session
    if servers := named_pool(env_servers):
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
    result = game.result
    try:
        await game.play(session)
    except ServerMismatch:
        raise
    except EnvCallTimeout as e:
        logger.warning("[chat_core] episode %s: %s; its session was closed", episode.task_name, e)
        result.flag(
            FlagKind.ENV_DEADLINE,
            f"{e} (env_call_deadline_s={limits.env_call_deadline_s:g}); the session was closed, abandoning the "
            "episode unscored",
        )
    except OpenEnvError as e:
        result.flag(_kind_of(e), str(e))
    finally:
        try:
            await game.env(None, session.close())
        finally:
            result.timings.capacity_wait_s = session.capacity_wait_s
            result.timings.env_s -= session.capacity_wait_s
            result.timings.wall_s = time.monotonic() - began
    return result


class _Episode:
    """One ``play``'s turns on the env: the result being built, the conversation with the model, and the limits
    that bound them."""

    def __init__(
        self, episode: EpisodeRef, chat: ChatEndpoint, sampling: Mapping[str, Any], limits: Limits, trace: EpisodeTrace
    ):
        self.result = EpisodeResult(episode=episode)
        self._conversation = Conversation(chat, sampling, limits, self.result, trace)
        self._limits = limits
        self._trace = trace
        self._system_prompt: str | None = None

    async def play(self, session: Session) -> None:
        """Play the episode through, scored or flagged. Each env answer is read in a call that returns before the
        episode waits again, so no answer stays alive across a wait: with a thousand episodes in flight, whatever
        outlives a wait reaches the garbage collector's oldest generation, whose collections go through all of it."""
        playing = await self._first_turn(session)
        while playing:
            playing = self._next_turn(await self._play_turn(session))

    async def env(self, span: str | None, call: Awaitable[Any]) -> Any:
        """``call``'s answer, its time counted as the env's, in a trace span of its own when ``span`` names one (a
        caller that adds attributes opens the span itself)."""
        began = time.monotonic()
        try:
            if span is None:
                return await call
            with self._trace.span(span, {"turn": len(self.result.turns)}):
                return await call
        finally:
            self.result.timings.env_s += time.monotonic() - began

    async def _first_turn(self, session: Session) -> bool:
        """Start the row's task on ``session`` and open its first turn; False when the episode ended instead (scored
        or flagged)."""
        episode = self.result.episode
        started = await self.env("reset", session.reset(episode.split, episode.index))
        self.result.env_server = session.url
        if started.done:
            self._finish(started)
            return False
        served = (started.task or {}).get("id")
        if served != episode.task_id:
            self.result.flag(
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
            self.result.flag(
                FlagKind.TURN_LIMIT,
                f"the env opened turn {len(self.result.turns) + 1}, past max_turns={self._limits.max_turns}; "
                "the episode was abandoned unscored",
            )
            return False
        opened = ended.body.get("result")
        if not isinstance(opened, dict) or not isinstance(opened.get("prompt"), str):
            self.result.flag(
                FlagKind.PROTOCOL_ERROR,
                f"end_turn neither ended the episode nor opened a turn: {excerpt(ended.body, FLAG_EXCERPT)}",
            )
            return False
        self._open_turn(opened)
        return True

    def _open_turn(self, prompts: Mapping[str, Any]) -> None:
        """Add the turn's prompt as a user message, after its system prompt when it brings a new one."""
        system_prompt = prompts.get("system_prompt")
        if isinstance(system_prompt, str) and system_prompt and system_prompt != self._system_prompt:
            self._conversation.say({"role": "system", "content": system_prompt})
            self._system_prompt = system_prompt
        self._conversation.say({"role": "user", "content": str(prompts.get("prompt") or "")})
        self.result.turns.append(TurnCounts())

    async def _play_turn(self, session: Session) -> Observation | None:
        """What ``end_turn`` answered, or None when the episode stopped during the turn (flagged): the model is
        asked again after each reply whose tool calls were all answered, and the turn is handed back with the reply
        that makes none, or with the response a call ends it with."""
        listed = await self.env("list_tools", session.list_tools())
        if listed.done:
            self._finish(listed)
            return None
        tools = Conversation.tools_of(listed.tools)
        latest_text = ""
        while True:
            try:
                reply = await self._conversation.ask(tools)
            except ContextFull as full:
                why = f"the next prompt doesn't fit the model's context ({full})"
                return await self._cut_short(session, FlagKind.CONTEXT_EXHAUSTED, why, latest_text)
            if reply is None:
                return None
            self._took(reply)
            if reply.truncated and not self._limits.play_on_cut_reply:
                why = (
                    f"reply {self.result.turns[-1].model_calls} was cut at the model's token limit (finish_reason "
                    "'length'), and play_on_cut_reply is false"
                )
                return await self._cut_short(session, FlagKind.RESPONSE_LIMIT, why, reply.text)
            latest_text = reply.text
            handed_back = await self._run_calls(session, reply) if reply.tool_calls else reply.text
            if handed_back is _STOPPED:
                return None
            if handed_back is not None:
                return await self._end_turn(session, handed_back)

    def _took(self, reply: Reply) -> None:
        """Count the model's ``reply``, add it to the transcript, and flag it when it was cut at the token limit and
        is played on."""
        counts = self.result.turns[-1]
        counts.model_calls += 1
        self._conversation.say(reply.message)
        if reply.truncated and self._limits.play_on_cut_reply:
            self.result.flag(
                FlagKind.REPLY_TRUNCATED,
                f"turn {len(self.result.turns)}: reply {counts.model_calls} was cut at the model's token limit "
                "(finish_reason 'length'); it was played as it came, as play_on_cut_reply asks",
            )

    async def _cut_short(self, session: Session, kind: FlagKind, why: str, response: str) -> Observation | None:
        """End the episode in the turn it is in, because of ``why``, flagged ``kind``: unscored, or, with
        ``score_cut_short``, handing the turn to the env with ``response`` (the latest reply's text) and returning
        what ``end_turn`` answered when it ended the episode."""
        turn = len(self.result.turns)
        if not self._limits.score_cut_short:
            self.result.flag(
                kind,
                f"turn {turn}: {why}; the episode ended there unscored, its verifiers not run (score_cut_short is "
                "false)",
            )
            return None
        ended = await self._end_turn(session, response)
        if not ended.done:
            self.result.flag(
                kind,
                f"turn {turn}: {why}; the turn was handed to the env with the latest reply's text, as "
                f"score_cut_short asks, but the env opened turn {turn + 1} rather than score the episode, so it "
                "ended unscored",
            )
            return None
        self.result.flag(
            kind,
            f"turn {turn}: {why}; the turn was handed to the env with the latest reply's text and the episode scored "
            "as it stands, as score_cut_short asks",
            fatal=False,
        )
        return ended

    async def _run_calls(self, session: Session, reply: Reply) -> str | _Stopped | None:
        """Run ``reply``'s tool calls in order and answer each. Returns the response the turn is handed back with
        when a call ends the turn (``end_turn``, or one past the turn's tool-call limit, which ends it with the
        reply's text), ``_STOPPED`` when the env ended the episode during a call, and None when every call was
        answered."""
        counts = self.result.turns[-1]
        for position, call in enumerate(reply.tool_calls):
            name = call["function"]["name"]
            arguments = arguments_of(call["function"].get("arguments"))
            if name == END_TURN:
                arguments = _end_turn_arguments(arguments, reply.text)
                if isinstance(arguments, dict):
                    self._conversation.answer(call, "Your turn has ended.")
                    self._skip(reply.tool_calls[position + 1 :], "the turn had already ended")
                    return arguments["response"]
            if counts.tool_calls >= self._limits.max_tool_calls_per_turn:
                self.result.flag(
                    FlagKind.TOOL_CALL_LIMIT,
                    f"turn {len(self.result.turns)}: the model called more than max_tool_calls_per_turn="
                    f"{self._limits.max_tool_calls_per_turn} tools; the turn was ended with its latest text",
                )
                self._skip(reply.tool_calls[position:], "the turn's tool-call limit was reached")
                return reply.text
            if not await self._run_call(session, call, name, arguments):
                return _STOPPED
        return None

    def _skip(self, calls: Sequence[dict[str, Any]], why: str) -> None:
        """Answer ``calls`` as not run, because of ``why``, and count them dropped."""
        self.result.turns[-1].dropped_tool_calls += len(calls)
        self._conversation.skip(calls, why)

    async def _run_call(
        self, session: Session, call: dict[str, Any], name: str, arguments: dict[str, Any] | str
    ) -> bool:
        """Run the tool call ``call`` of tool ``name`` on the env and answer it, or answer it as an error when its
        ``arguments`` are why they can't be run; False when the env ended the episode instead."""
        counts = self.result.turns[-1]
        counts.tool_calls += 1
        if isinstance(arguments, str):
            counts.tool_errors += 1
            self.result.flag(
                FlagKind.BAD_TOOL_ARGUMENTS,
                f"turn {len(self.result.turns)}: {name}: {arguments}; answered as a tool error",
            )
            self._conversation.answer(call, f"error: {arguments}")
            return True
        with self._trace.span("tool_call", {"turn": len(self.result.turns), "tool": name}) as end:
            answered = await self.env(None, session.call_tool(name, arguments))
            if answered.done:
                self._finish(answered)
                return False
            text, failed = _tool_answer(answered)
            end["error"] = failed
        counts.tool_errors += failed
        self._conversation.answer(call, self._capped(text))
        return True

    def _capped(self, text: str) -> str:
        """A tool answer's ``text`` as the model is shown it: cut to ``Limits.max_tool_answer_chars`` when longer,
        with a line saying how much more the tool answered, and counted."""
        cap = self._limits.max_tool_answer_chars
        if len(text) <= cap:
            return text
        cut = text[cap:]
        self.result.tool_answers_cut += 1
        self.result.tool_answer_bytes_cut += len(cut.encode("utf-8", "surrogatepass"))
        return text[:cap] + TOOL_ANSWER_CUT.format(characters=len(cut), cap=cap)

    async def _end_turn(self, session: Session, response: str) -> Observation:
        with self._trace.span(END_TURN, {"turn": len(self.result.turns)}) as end:
            ended = await self.env(None, session.call_tool(END_TURN, {"response": response}))
            end["episode_ended"] = ended.done
        return ended

    def _finish(self, ended: Observation) -> None:
        """Score an episode the env ended, or flag why it can't be."""
        if ended.error is not None:
            return self.result.flag(FlagKind.ENV_FAILED, ended.error)
        reward = ended.reward
        if reward is None or not math.isfinite(reward):
            scores = ended.metadata.get("scores")
            return self.result.flag(
                FlagKind.NO_REWARD,
                f"the env ended the episode with reward {reward!r}" + (f" (scores {scores})" if scores else ""),
            )
        self.result.reward = float(reward)
        return None


class _Stopped:
    """The episode stopped during a tool call: the env ended it."""


_STOPPED = _Stopped()


def _end_turn_arguments(arguments: dict[str, Any] | str, text: str) -> dict[str, Any] | str:
    """``end_turn``'s arguments as ``{"response": string}``, the reply's ``text`` when the model gave no response,
    or why they can't be."""
    if isinstance(arguments, str):
        return arguments
    response = arguments.get("response", text)
    if isinstance(response, str):
        return {"response": response}
    return f'end_turn takes {{"response": string}}, not a response of {excerpt(response, FLAG_EXCERPT)}'


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
